"""Greedy MTP speculative decoding in one compiled device loop (``decode.spec_loop``, ``DecodeEngine.
decode_speculative_greedy``, ``GenerationConfig(speculative="mtp", decode_loop=N)``; issue 34).

On the CPU in float32: the device drafts equal the host drafter's; the engine loop gives per step the accepted
counts, tokens and drafter windows of the host speculative step; rejected drafts' stale K/V are never read;
``generate`` with the loop gives plain greedy's tokens and stop reasons and the host speculative path's
drafted / accepted counts (random M2 and M3 models: drafts mostly rejected; chain models whose MTP modules
draft exactly, everywhere or in part: multi-token acceptance); the config and CLI accept the combination.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.decode import DecodeEngine
from minimax_jax.decode.spec_loop import accept_greedy_counts, draft_greedy
from minimax_jax.infer import GenerationConfig, Generator
from minimax_jax.infer.drafter import MTPDrafter
from minimax_jax.infer.sampler import SamplingParams
from minimax_jax.infer.speculative import accept_greedy
from minimax_jax.model.params import init_params
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")


@functools.lru_cache(maxsize=None)
def random_model(kind: str):
    """2-layer float32 models with 2 random MTP modules: "m3" = dense + MSA/MoE (block 16), "m2" = dense-attention
    MoE."""
    if kind == "m3":
        cfg = ModelConfig.from_yaml("configs/tiny-m3.yaml").replace(
            num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "moe"), num_mtp_modules=2)
    else:
        cfg = ModelConfig.from_yaml("configs/tiny-m2.yaml").replace(
            num_layers=2, layer_types=("full", "full"), mlp_types=("moe", "moe"), num_mtp_modules=2)
    params = init_params(cfg, jax.random.PRNGKey(7))
    params["mtp"] = jax.tree.map(jnp.asarray, H.random_mtp(cfg, seed=3))
    return cfg, params


@functools.lru_cache(maxsize=None)
def chain(drop: tuple = ()):
    """The cycling chain model with 3 exact MTP modules; ``drop``: ``(depth, chain index)`` pairs whose module
    forgets that chain token (its ``eh_proj`` row zeroed: the draft becomes token 0 and is rejected)."""
    tok = H.chain_tokenizer(H.GOOD_PIECES)
    start = H.chat_prompt_ids(tok)[-1]
    cfg, params = H.chain_model(tok, H.GOOD_PIECES, start, cycle=True, mtp=3)
    for depth, j in drop:
        params["mtp"][depth - 1]["eh_proj"] = params["mtp"][depth - 1]["eh_proj"].copy()
        params["mtp"][depth - 1]["eh_proj"][j] = 0.0
    params = jax.tree.map(jnp.asarray, params)
    return cfg, params, tok, start


#: module 1 forgets chain tokens 2 and 5, module 2 token 8: from chain token 1 on, steps accept 3, 0, 3, 0, 3, 1, ...
MIXED = ((1, 2), (1, 5), (2, 8))


def _prompts(cfg, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]


def _greedy(logits, depth):
    return np.argmax(logits, axis=-1)


# ----------------------------------------------------------------------------- pieces
def test_accept_rule_is_one_on_host_and_device():
    rng = np.random.default_rng(0)
    for k in (0, 1, 3):
        logits = rng.integers(0, 3, (50, k + 1, 4)).astype(np.float32)     # many ties
        best = np.argmax(logits, axis=-1)
        drafts = np.where(rng.random((50, k)) < 0.7, best[:, :k], rng.integers(0, 4, (50, k)))
        want = np.array([accept_greedy(lg, d) for lg, d in zip(logits, drafts)]).reshape(50, 2)
        got_np = np.stack(accept_greedy_counts(best, drafts), 1)
        got_jax = np.stack([np.asarray(a) for a in jax.jit(accept_greedy_counts)(jnp.asarray(best),
                                                                                 jnp.asarray(drafts))], 1)
        np.testing.assert_array_equal(got_np, want)
        np.testing.assert_array_equal(got_jax, want)
        if k:
            assert len(set(want[:, 0])) > 1                      # several accepted counts were exercised


def _engine_with_drafter(cfg, params, prompts, window, max_len=160):
    eng = DecodeEngine(params, cfg, max_seqs=len(prompts), max_len=max_len, prefill_chunk=32, implementation="xla",
                       prefix_cache=False)
    slots, logits, hidden = eng.prefill(prompts, return_hidden=True, hidden_last=window)
    drafter = MTPDrafter(params, cfg, window=window)
    for s, p, h in zip(slots, prompts, hidden):
        drafter.start(s, p, h)
    pending = np.array([int(np.argmax(lg[0])) for lg in logits], np.int32)
    return eng, drafter, slots, pending


def test_device_drafts_equal_host_drafts():
    """A full window (prompt > W) and a padded one (prompt < W): draft_greedy == MTPDrafter.draft."""
    cfg, params = random_model("m3")
    _, drafter, slots, pending = _engine_with_drafter(cfg, params, _prompts(cfg, (30, 5), seed=1), window=12)
    host, _ = drafter.draft(slots, pending, _greedy)
    h, toks, count, length = drafter.window_arrays(slots)
    assert list(count) == [12, 5] and list(length) == [30, 5]
    dev = jax.jit(draft_greedy, static_argnames=("cfg", "num_draft"))(
        params, drafter.mtp, cfg, jnp.asarray(h), jnp.asarray(toks), jnp.asarray(count), jnp.asarray(length),
        jnp.asarray(pending), num_draft=drafter.num_draft)
    np.testing.assert_array_equal(np.asarray(dev), host)


def _host_steps(eng, drafter, slots, pending, steps):
    """``steps`` host speculative steps (``_Run.speculative_step``'s greedy path): ``(emitted [n][steps] lists,
    accepted [n, steps])``."""
    pending = [int(t) for t in pending]
    emitted, accepted = [[] for _ in slots], np.zeros((len(slots), steps), np.int32)
    for j in range(steps):
        drafts, _ = drafter.draft(slots, pending, _greedy)
        lengths = [eng.length(s) for s in slots]
        toks = np.concatenate([np.array(pending, np.int32)[:, None], drafts], 1)
        logits, hidden = eng.decode_step(toks, slots, return_hidden=True)
        for i, s in enumerate(slots):
            a, nxt = accept_greedy(logits[i], drafts[i])
            eng.truncate(s, lengths[i] + 1 + a)
            drafter.extend(s, [pending[i]] + list(drafts[i, :a]), hidden[i, :1 + a])
            emitted[i].append([int(t) for t in drafts[i, :a]] + [nxt])
            accepted[i, j] = a
            pending[i] = nxt
    return emitted, accepted


@pytest.mark.parametrize("model,window,iters", [("m3", 12, 5), (("chain", MIXED), 4, 6)])
def test_engine_loop_equals_host_speculative_steps(model, window, iters):
    """Per step: accepted counts and tokens; after the loop: the drafter windows, the slots' tokens and lengths.
    The partly exact chain model (``MIXED``) accepts 0, 1 or all 3 drafts by position (multi-token acceptance, a
    window shifted by 1, 2 or 4 positions); the random M3 model rejects nearly every draft (stale K/V of rejected
    drafts)."""
    if model == "m3":
        cfg, params = random_model("m3")
        prompts = _prompts(cfg, (40, 7), seed=2)
    else:
        cfg, params, _, start = chain(model[1])
        prompts = [[7, 3, 9, start], [start]]
    runs = []
    for device in (False, True):
        eng, drafter, slots, pending = _engine_with_drafter(cfg, params, prompts, window)
        if device:
            em, acc, (h, toks, count) = eng.decode_speculative_greedy(
                pending, slots, iters, drafter.mtp, drafter.window_arrays(slots)[:3], drafter.num_draft)
            assert em.shape == (2, iters, drafter.num_draft + 1)
            emitted = [[[int(t) for t in e[:a + 1]] for e, a in zip(em[i], acc[i])] for i in range(2)]
            for i, s in enumerate(slots):
                drafter.set_window(s, h[i], toks[i], int(count[i]), eng.length(s))
        else:
            emitted, acc = _host_steps(eng, drafter, slots, pending, iters)
        runs.append((emitted, np.asarray(acc), [list(eng.seqs[s].tokens) for s in slots],
                     drafter.window_arrays(slots), [len(eng.seqs[s].pages) for s in slots]))
    (e0, a0, t0, w0, p0), (e1, a1, t1, w1, p1) = runs
    assert e0 == e1
    np.testing.assert_array_equal(a0, a1)
    assert t0 == t1 and p0 == p1                              # pages past the new end were released
    for x, y in zip(w0[1:], w1[1:]):                           # window tokens, counts, lengths
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(w0[0], w1[0], atol=1e-5)       # hidden states (the loop's compiled rounding)
    if model != "m3":
        assert a0.tolist() == [[3, 0, 3, 0, 3, 1]] * 2


def test_stale_rejected_keys_are_never_read():
    """K/V of rejected drafts stay past a row's end (no erase). A loop over a cache whose positions past the
    prompt hold garbage (written, then truncated away: on the partial last page and on a released page) gives
    exactly the outputs of a loop over a clean cache: each query sees only keys at positions <= its own, and a
    step writes its positions before any layer reads them (the MSA layer selects only complete earlier pages)."""
    cfg, params = random_model("m3")
    prompts = _prompts(cfg, (40, 21), seed=3)
    outs = []
    for dirty in (False, True):
        eng, drafter, slots, pending = _engine_with_drafter(cfg, params, prompts, window=8)
        if dirty:
            garbage = np.random.default_rng(9).integers(3, cfg.vocab_size, (2, 14))
            lengths = [eng.length(s) for s in slots]
            eng.decode_step(garbage, slots)
            for s, n in zip(slots, lengths):
                eng.truncate(s, n)
        em, acc, win = eng.decode_speculative_greedy(pending, slots, 4, drafter.mtp, drafter.window_arrays(slots)[:3],
                                                     drafter.num_draft)
        outs.append((em, acc, win))
    (e0, a0, w0), (e1, a1, w1) = outs
    np.testing.assert_array_equal(a0, a1)
    keep = np.arange(e0.shape[-1]) <= a0[..., None]                       # the emitted entries
    np.testing.assert_array_equal(np.where(keep, e0, -1), np.where(keep, e1, -1))
    for x, y in zip(w0, w1):                                               # bit for bit, hidden states too
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- generate
def _compare(gen, prompts, config, loop):
    plain = gen.generate(prompts, dataclasses.replace(config, speculative=None))
    host = gen.generate(prompts, config)
    dev = gen.generate(prompts, dataclasses.replace(config, decode_loop=loop))
    want = [(s.tokens, s.stop_reason) for s in plain.sequences]
    assert [(s.tokens, s.stop_reason) for s in host.sequences] == want
    assert [(s.tokens, s.stop_reason) for s in dev.sequences] == want
    assert (dev.stats.drafted, dev.stats.accepted) == (host.stats.drafted, host.stats.accepted)
    assert f"decode loop={loop}" in dev.stats.engine and dev.stats.decode_loop == loop
    # steps counted up to the last one whose tokens a row used: as many as one step at a time
    assert dev.stats.decode_steps == host.stats.decode_steps
    assert dev.stats.tokens_per_step == host.stats.tokens_per_step
    plain_loop = gen.generate(prompts, dataclasses.replace(config, speculative=None, decode_loop=loop))
    assert plain_loop.stats.decode_steps == plain.stats.decode_steps
    return plain, host, dev


@pytest.mark.parametrize("kind,lengths", [("m3", (37, 5, 70)), ("m2", (20, 3, 45))])
def test_generate_loop_equals_plain_greedy(kind, lengths):
    """3 rows of different lengths, 23 new tokens (no multiple of a loop's tokens), then a stop token that row 1
    meets inside a loop: plain greedy's tokens and stop reasons, the host speculative path's counts."""
    cfg, params = random_model(kind)
    prompts = _prompts(cfg, lengths, seed=4)
    gen = Generator(cfg, params)
    config = GenerationConfig(max_new_tokens=23, stop_token_ids=(), speculative="mtp")
    plain, host, _ = _compare(gen, prompts, config, 3)
    assert host.stats.drafted > 0 and all(len(s.tokens) == 23 for s in plain.sequences)
    stop = plain.sequences[1].tokens[7]
    plain, _, dev = _compare(gen, prompts, dataclasses.replace(config, stop_token_ids=(stop,)), 3)
    assert plain.sequences[1].stop_reason == "stop_token"


def test_generate_loop_exact_mtp_accepts_every_draft():
    cfg, params, tok, start = chain()
    gen = Generator(cfg, params, tok)
    prompts = [[7, 3, start], [start]]
    config = GenerationConfig(max_new_tokens=30, stop_token_ids=(), speculative="mtp", num_draft=3)
    plain, host, dev = _compare(gen, prompts, config, 4)
    st = dev.stats
    assert st.acceptance_rate == 1.0 and st.accepted == st.drafted > 0
    assert st.decode_steps < plain.stats.decode_steps / 3                  # 4 tokens per verify step


def test_generate_loop_partial_acceptance_and_context_end():
    """The partly exact chain model up to the model's context: loops, then host speculative steps where a whole
    loop no longer fits (they draft from the windows the loops returned)."""
    cfg, params, tok, start = chain(MIXED)
    cfg = cfg.replace(max_position_embeddings=64)
    gen = Generator(cfg, params, tok)
    prompts = [[7, 3] * 14 + [start], [9, start]]
    config = GenerationConfig(max_new_tokens=35, stop_token_ids=(), speculative="mtp", num_draft=3, mtp_window=6)
    plain, host, dev = _compare(gen, prompts, config, 3)
    st = dev.stats
    assert len(plain.sequences[0].tokens) == 35
    assert 1 / 3 < st.acceptance_rate < 1                  # some rejected; > 1 of the 3 drafts kept per row and step


# ----------------------------------------------------------------------------- config / CLI
def test_config_and_cli_take_the_speculative_loop():
    from minimax_jax.infer import cli as infer_cli

    assert GenerationConfig(decode_loop=8, speculative="mtp").tokens_past_limit(3) == 32
    with pytest.raises(ValueError, match="sampling"):
        GenerationConfig(decode_loop=8, speculative="mtp", sampling=SamplingParams(temperature=0.7))
    infer_cli.parse(["--prompt", "hi", "--temperature", "0", "--speculative", "mtp", "--decode_loop", "8"])
    infer_cli.check_flags()
    config = infer_cli._config()
    assert (config.speculative, config.decode_loop) == ("mtp", 8)
    infer_cli.parse(["--prompt", "hi", "--temperature", "0", "--speculative", "mtp"])
    assert infer_cli._config().decode_loop == 1                             # "auto" stays plain-only
