"""Repetition / presence / frequency penalties (minimax_jax/infer/penalties.py): the math against a
literal NumPy reference (and Hugging Face's repetition processor), the per-row state, the checks,
and greedy generation with penalties against a reference loop over full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.infer import GenerationConfig, Generator, SamplingParams
from minimax_jax.infer.penalties import PenaltyTracker, apply_logit_bias, apply_penalties
from minimax_jax.model import forward
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")


def reference(logits, context, generated, rep=1.0, pres=0.0, freq=0.0):
    """Token by token, float64: CTRL/HF repetition over prompt + generated, OpenAI presence/frequency over
    the generated tokens."""
    out = np.array(logits, np.float64)
    for b in range(out.shape[0]):
        for t in set(context[b]):
            out[b, t] = out[b, t] / rep if out[b, t] > 0 else out[b, t] * rep
        for t in set(generated[b]):
            c = list(generated[b]).count(t)
            out[b, t] -= freq * c + pres
    return out



def test_logit_bias_adds_to_the_listed_columns_of_every_row():
    logits, _, _ = _case(5)
    got = apply_logit_bias(logits, [3, 0, 36], [100.0, -2.5, 0.25])
    want = np.array(logits, np.float64)
    want[:, 3] += 100.0
    want[:, 0] -= 2.5
    want[:, 36] += 0.25
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(apply_logit_bias(logits, [], []), logits)
    with pytest.raises(ValueError, match="token ids must lie in"):
        apply_logit_bias(logits, [37], [1.0])
    with pytest.raises(ValueError, match="must be"):
        apply_logit_bias(logits, [1, 2], [1.0])


def _case(seed, b=4, v=37):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((b, v))).astype(np.float32)
    prompts = [rng.integers(0, v, rng.integers(1, 9)).tolist() for _ in range(b)]
    gens = [rng.integers(0, v, rng.integers(0, 12)).tolist() for _ in range(b)]
    return logits, prompts, gens


def _state(v, prompts, gens):
    tr = PenaltyTracker(v)
    for r, (p, g) in enumerate(zip(prompts, gens)):
        tr.start(r, p)
        for t in g:
            tr.add(r, t)
    return tr


@pytest.mark.parametrize("rep, pres, freq", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.8),
                                             (1.2, -0.4, 0.3), (2.0, 2.0, -2.0)])
def test_penalties_match_the_numpy_reference(rep, pres, freq):
    for seed in range(3):
        logits, prompts, gens = _case(seed)
        ctx = [p + g for p, g in zip(prompts, gens)]
        got = _state(logits.shape[1], prompts, gens).apply(logits, range(len(prompts)), repetition_penalty=rep,
                                                           presence_penalty=pres, frequency_penalty=freq)
        want = reference(logits, ctx, gens, rep, pres, freq)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.any(got != logits)                     # the case does penalise something


def test_no_penalty_is_the_identity_bit_for_bit():
    logits, prompts, gens = _case(7)
    got = _state(logits.shape[1], prompts, gens).apply(logits, range(4))
    assert got.tobytes() == logits.tobytes()
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties


def test_repetition_penalty_equals_hugging_face():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    logits, prompts, gens = _case(3, b=1, v=50)
    ids = torch.tensor([prompts[0] + gens[0]])
    want = tf.RepetitionPenaltyLogitsProcessor(1.7)(ids, torch.tensor(logits)).numpy()
    got = _state(50, prompts, gens).apply(logits, [0], repetition_penalty=1.7)
    np.testing.assert_array_equal(got, want)


def test_penalty_checks():
    with pytest.raises(ValueError, match="must all be"):
        apply_penalties(np.zeros((2, 5)), np.zeros((2, 4), bool), np.zeros((2, 5)))
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        apply_penalties(np.zeros((1, 3)), np.zeros((1, 3), bool), np.zeros((1, 3)), repetition_penalty=0.0)
    for kw, match in [(dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                      (dict(presence_penalty=2.5), "presence_penalty must be in"),
                      (dict(frequency_penalty=-3.0), "frequency_penalty must be in"),
                      (dict(frequency_penalty=float("nan")), "finite")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="penalties need plain decoding"):
        GenerationConfig(speculative="mtp", sampling=SamplingParams(repetition_penalty=1.2))


@pytest.fixture(scope="module")
def model():
    tok = H.tiny_tokenizer()
    cfg = H.tiny_config(tok.get_vocab_size())
    rng = np.random.default_rng(0)
    from minimax_jax.model import abstract_params

    params = jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype), abstract_params(cfg))
    return cfg, params, tok


def _reference_greedy(cfg, params, prompt, n, **pen):
    """Full causal forward over the sequence right-padded to 16 (one compile; padding after the last
    position cannot change it), reference penalties, argmax."""
    run = jax.jit(lambda t: forward(params, cfg, t).logits)
    seq, gen = list(prompt), []
    for _ in range(n):
        logits = np.asarray(run(jnp.asarray([seq + [0] * (16 - len(seq))])))[0, len(seq) - 1:len(seq)]
        x = reference(logits, [seq], [gen], pen.get("rep", 1.0), pen.get("pres", 0.0), pen.get("freq", 0.0))
        gen.append(int(np.argmax(x)))
        seq.append(gen[-1])
    return gen


def test_greedy_generation_with_and_without_penalties(model):
    cfg, params, tok = model
    gen = Generator(cfg, params, tok)
    prompts = [[5, 9, 5, 17, 9], [40, 41, 42]]
    plain = GenerationConfig(max_new_tokens=10, stop_token_ids=())
    out = gen.generate(prompts, plain).sequences
    for p, s in zip(prompts, out):
        assert s.tokens == _reference_greedy(cfg, params, p, 10)
    pen = dict(rep=1.8, pres=0.7, freq=0.9)
    cfgp = GenerationConfig(max_new_tokens=10, stop_token_ids=(), sampling=SamplingParams(
        repetition_penalty=pen["rep"], presence_penalty=pen["pres"], frequency_penalty=pen["freq"]))
    penalised = gen.generate(prompts, cfgp).sequences
    for p, s in zip(prompts, penalised):
        assert s.tokens == _reference_greedy(cfg, params, p, 10, **pen)
    assert [s.tokens for s in penalised] != [s.tokens for s in out]     # the penalties changed something
    # the plain runs repeat tokens: the penalties had something to act on
    assert any(len(set(s.tokens)) < len(s.tokens) for s in out)
