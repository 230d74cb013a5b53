"""MTP speculative decoding: the acceptance rule keeps the target distribution; with the chain
model's exact MTP modules every draft is accepted and the output (also its stop inside an accepted
run) equals plain greedy decoding; sampled speculative decoding is seeded.
(Random MTP weights on an HF-derived model: test_infer_speculative_m2.py.)"""

import jax
import numpy as np
import pytest

from minimax_jax.infer import GenerationConfig, Generator, InferenceError, SamplingParams
from minimax_jax.infer.backends import PagedBackend
from minimax_jax.infer.speculative import accept_greedy, accept_sampled
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")

CHI2_DF5_P999 = 20.52  # 99.9% quantile of chi-square with 5 degrees of freedom


def _chi2(counts, probs):
    n = counts.sum()
    return float(((counts - n * probs) ** 2 / (n * probs)).sum())


def _dists(rng, v, k):
    return rng.dirichlet(np.ones(v), size=k)


def test_accept_sampled_preserves_target_distribution():
    rng = np.random.default_rng(0)
    v, n = 6, 20000
    p = _dists(rng, v, 3)          # target distributions at draft positions 1, 2 and the bonus
    q = _dists(rng, v, 2)          # draft distributions
    first, second = np.zeros(v), np.zeros(v)
    naive_first = np.zeros(v)
    for _ in range(n):
        drafts = np.array([rng.choice(v, p=q[0]), rng.choice(v, p=q[1])])
        a, nxt = accept_sampled(p, q, drafts, rng)
        emitted = list(drafts[:a]) + [nxt]
        first[emitted[0]] += 1
        if a >= 1:                  # given d_1 accepted, the next token must follow p_2
            second[emitted[1]] += 1
        naive_first[drafts[0]] += 1  # "always accept" would give q_1
    assert _chi2(first, p[0]) < CHI2_DF5_P999
    assert _chi2(second, p[1]) < CHI2_DF5_P999
    assert _chi2(naive_first, p[0]) > 10 * CHI2_DF5_P999   # the test can tell q from p


def test_accept_sampled_identical_distributions_accept_everything():
    rng = np.random.default_rng(1)
    p = _dists(rng, 5, 4)
    drafts = np.array([rng.choice(5, p=p[i]) for i in range(3)])
    assert accept_sampled(p, p[:3], drafts, rng)[0] == 3


def test_accept_greedy():
    logits = np.array([[0, 3, 1], [5, 0, 0], [0, 0, 2]], np.float32)   # argmax 1, 0, 2
    assert accept_greedy(logits, np.array([1, 0])) == (2, 2)
    assert accept_greedy(logits, np.array([1, 2])) == (1, 0)
    assert accept_greedy(logits, np.array([0, 0])) == (0, 1)
    assert accept_greedy(np.array([[1, 1, 0]], np.float32), np.array([], np.int32)) == (0, 0)  # ties: lowest id


@pytest.fixture(scope="module")
def chain():
    tok = H.chain_tokenizer(H.GOOD_PIECES)
    start = H.chat_prompt_ids(tok)[-1]
    cfg, params = H.chain_model(tok, H.GOOD_PIECES, start, mtp=3)
    return cfg, params, tok, start


@pytest.mark.parametrize("num_draft,window", [(1, 64), (3, 2)])   # window 2 < context: drafter keeps a tail
def test_exact_mtp_accepts_every_draft_and_stops_on_time(chain, num_draft, window):
    cfg, params, tok, start = chain
    gen = Generator(cfg, params, tok, engine="recompute")
    prompts = [[7, 3, start], [start]]
    plain = gen.generate(prompts, GenerationConfig(max_new_tokens=40))
    spec = gen.generate(prompts, GenerationConfig(max_new_tokens=40, speculative="mtp", num_draft=num_draft,
                                                  mtp_window=window))
    want = "".join(H.GOOD_PIECES[:-1])
    for p, s in zip(plain.sequences, spec.sequences):
        assert p.text == want and p.stop_reason == "stop_token"
        assert (s.tokens, s.text, s.stop_reason) == (p.tokens, p.text, p.stop_reason)
    # every draft verified before the end-of-turn token was accepted
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.decode_steps < plain.stats.decode_steps


def test_a_window_longer_than_any_row_is_cut_to_the_rows(chain):
    """mtp_window 8192 on 40-token rows: the drafter's window is the longest row rounded up to a power of two
    (64 here; only padding is dropped, so the same tokens and accepted drafts as a window of exactly 64)."""
    cfg, params, tok, start = chain
    gen = Generator(cfg, params, tok, engine="recompute")
    prompts = [[7, 3, start], [start]]
    runs = [gen.generate(prompts, GenerationConfig(max_new_tokens=40, speculative="mtp", num_draft=1, mtp_window=w))
            for w in (8192, 64)]
    assert [d.window for d in gen._drafters.values()] == [64]          # one drafter, cut to 64
    assert [s.tokens for s in runs[0].sequences] == [s.tokens for s in runs[1].sequences]
    assert runs[0].stats.acceptance_rate == runs[1].stats.acceptance_rate == 1.0
    with pytest.raises(ValueError, match=r"mtp_window must be an int in \[1, 8192\], got 8193"):
        GenerationConfig(speculative="mtp", mtp_window=8193)


def test_sampled_speculative_is_seeded(chain):
    cfg, params, tok, start = chain
    gen = Generator(cfg, params, tok, engine="recompute")
    cfgs = [GenerationConfig(max_new_tokens=12, speculative="mtp", stop_token_ids=(),
                             sampling=SamplingParams(temperature=3.0, seed=s)) for s in (1, 1, 2)]
    runs = [gen.generate([[start]], c).sequences[0].tokens for c in cfgs]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_speculative_needs_mtp_modules(chain):
    cfg, params, tok, start = chain
    no_mtp = {k: v for k, v in params.items() if k != "mtp"}
    gen = Generator(cfg.replace(num_mtp_modules=0), no_mtp, tok, engine="recompute")
    with pytest.raises(InferenceError, match="needs a checkpoint with MTP modules"):
        gen.generate([[start]], GenerationConfig(max_new_tokens=4, speculative="mtp"))


@pytest.mark.skipif(not PagedBackend.engine_returns_hidden(),
                    reason="minimax_jax.decode has no return_hidden= yet (the error is tested in *_m2.py)")
def test_paged_engine_exact_mtp_equals_plain(chain):
    cfg, params, tok, start = chain
    gen = Generator(cfg, params, tok)          # paged
    prompts = [[7, 3, start], [start]]
    plain = gen.generate(prompts, GenerationConfig(max_new_tokens=40))
    spec = gen.generate(prompts, GenerationConfig(max_new_tokens=40, speculative="mtp", num_draft=3))
    for p, s in zip(plain.sequences, spec.sequences):
        assert (s.tokens, s.text, s.stop_reason) == (p.tokens, p.text, p.stop_reason)
    assert spec.stats.acceptance_rate == 1.0 and spec.stats.engine.startswith("paged")
