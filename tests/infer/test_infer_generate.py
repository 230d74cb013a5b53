"""The generation loop on the paged engine: batched prompts of different lengths equal single runs,
seeded sampling, stop strings / ids / repetition, streaming deltas, and the eval adapters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.eval.runner import model_fns_from_mapping
from minimax_jax.infer import (GenerationConfig, Generator, LoadedModel, SamplingParams, generate, make_eval_fns,
                               make_generate_fn, make_logprob_fn)
from minimax_jax.model import forward
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def chain():
    tok = H.chain_tokenizer(H.GOOD_PIECES)
    start = H.chat_prompt_ids(tok)[-1]
    cfg, params = H.chain_model(tok, H.GOOD_PIECES, start)
    return cfg, jax.tree.map(jnp.asarray, params), tok, start


@pytest.fixture(scope="module")
def random_model(chain):
    """The chain config with random weights everywhere (context-dependent, not scripted)."""
    cfg, params, tok, _ = chain
    rng = np.random.default_rng(0)
    rand = jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype), params)
    return cfg, rand, tok


@pytest.fixture(scope="module")
def gen(random_model):
    cfg, params, tok = random_model
    return Generator(cfg, params, tok)      # paged; one engine reused by every test here


def test_batch_of_different_lengths_equals_single_runs(gen):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 300, n).tolist() for n in (3, 17, 8)]
    cfg = GenerationConfig(max_new_tokens=12, stop_token_ids=())
    batch = gen.generate(prompts, cfg)
    assert batch.stats.engine.startswith("paged")
    for p, s in zip(prompts, batch.sequences):
        assert gen.generate([p], cfg).sequences[0].tokens == s.tokens
        assert len(s.tokens) == 12 and s.stop_reason == "length"


def test_sampling_is_seeded_and_per_row(gen):
    prompts = [[11, 12, 13], [40, 41]]

    def run(seed, ps=prompts, **kw):
        c = GenerationConfig(max_new_tokens=10, stop_token_ids=(),
                             sampling=SamplingParams(temperature=1.5, seed=seed, **kw))
        return [s.tokens for s in gen.generate(ps, c).sequences]

    a = run(3)
    assert a == run(3)
    assert a != run(4)
    assert run(3, ps=prompts[:1]) == a[:1]          # a row's draws do not depend on the rest of the batch
    top1 = run(5, top_k=1)                            # top-k 1 is greedy whatever the seed
    greedy = [s.tokens for s in gen.generate(prompts, GenerationConfig(max_new_tokens=10, stop_token_ids=())).sequences]
    assert top1 == greedy


def test_stops_and_streaming(chain):
    cfg, params, tok, start = chain
    g = Generator(cfg, params, tok)
    full = "".join(H.GOOD_PIECES[:-1])
    deltas = []
    out = g.generate([[start]], GenerationConfig(max_new_tokens=30), on_text=lambda r, d: deltas.append(d))
    s = out.sequences[0]
    assert (s.text, s.stop_reason, s.stop_detail) == (full, "stop_token", cfg.eos_token_id)
    assert "".join(deltas) == full and len(deltas) > 3

    deltas = []
    out = g.generate([[start]], GenerationConfig(max_new_tokens=30, stop_strings=("<invoke",)),
                     on_text=lambda r, d: deltas.append(d))
    s = out.sequences[0]
    assert s.stop_reason == "stop_string" and s.text == full[:full.index("<invoke")]
    assert "".join(deltas) == s.text                  # nothing past the stop string was streamed

    think_close = tok.token_to_id("</think>")
    s = g.generate([[start]], GenerationConfig(max_new_tokens=30, stop_token_ids=(think_close,))).sequences[0]
    assert (s.text, s.stop_reason) == ("Let me check.", "stop_token")

    s = g.generate([[start]], GenerationConfig(max_new_tokens=3)).sequences[0]
    assert s.stop_reason == "length" and len(s.tokens) == 3


def test_repetition_stop(chain):
    cfg, _, tok, start = chain
    pieces = H.GOOD_PIECES[:4]
    _, params = H.chain_model(tok, pieces, start, cycle=True)
    g = Generator(cfg, params, tok)
    s = g.generate([[start]], GenerationConfig(max_new_tokens=40, repeat_max_period=4,
                                               repeat_max_count=2)).sequences[0]
    assert s.stop_reason == "repetition" and s.stop_detail == 4
    assert len(s.tokens) == 12                         # 3 copies of the 4-token cycle


def test_eval_adapters(chain, random_model, tmp_path):
    cfg, params, tok, start = chain
    m = LoadedModel(cfg, params, tok, "mem", "test")
    generate_fn = make_generate_fn(m, batch_size=1)   # batch 1: reuses the compiled single-row engine
    prompt = tok.decode([start], skip_special_tokens=False)
    assert generate_fn([prompt, prompt], 30) == ["".join(H.GOOD_PIECES[:-1])] * 2

    rcfg, rparams, _ = random_model
    logprob_fn = make_logprob_fn(LoadedModel(rcfg, rparams, tok, "mem", "test"))
    tokens = np.random.default_rng(2).integers(0, rcfg.vocab_size, (2, 9)).astype(np.int32)
    got = logprob_fn(tokens)
    ref = jax.nn.log_softmax(forward(rparams, rcfg, jnp.asarray(tokens)).logits, -1)
    ref = np.take_along_axis(np.asarray(ref)[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    assert got.shape == (2, 8)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

    ckpt = H.save_checkpoint(str(tmp_path / "ckpt"), cfg, params, tok)
    fns = model_fns_from_mapping(make_eval_fns(ckpt, max_seq_len=64))
    assert fns.generate_fn([prompt], 30) == ["".join(H.GOOD_PIECES[:-1])]


def test_one_shot_generate_api(chain):
    cfg, params, tok, start = chain
    out = generate([[start], [9, start]], cfg, params, tokenizer=tok, max_new_tokens=30)
    assert [s.text for s in out.sequences] == ["".join(H.GOOD_PIECES[:-1])] * 2
    assert out.stats.generated_tokens == 2 * (len(H.GOOD_PIECES) - 1)
