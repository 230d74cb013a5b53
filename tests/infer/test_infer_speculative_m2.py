"""MTP speculative decoding on a random HF-derived MiniMax-M2 model with random MTP modules (drafts
mostly rejected): the drafter's depths equal ``mtp_forward``; speculative greedy output equals plain
greedy output token for token; the paged engine either does it too or says why it cannot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.convert.from_state import params_from_hf_state
from minimax_jax.infer import EngineUnavailable, GenerationConfig, Generator
from minimax_jax.infer.drafter import mtp_depth, stack_mtp
from minimax_jax.model import forward, mtp_forward
from tests import hf_fixtures as hf
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def m2_mtp():
    hf.require_hf()
    model = hf.m2_model(seed=7)
    cfg = ModelConfig.from_hf_config(model.config.to_dict(), dtype="float32", param_dtype="float32",
                                     num_mtp_modules=3)
    params = params_from_hf_state(hf.state_of(model), cfg.replace(num_mtp_modules=0))
    params["mtp"] = jax.tree.map(jnp.asarray, H.random_mtp(cfg, seed=7))
    return cfg, params


def test_drafter_depths_equal_mtp_forward(m2_mtp):
    cfg, params = m2_mtp
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 12)), jnp.int32)

    @jax.jit
    def both(params, tokens):
        hidden = forward(params, cfg, tokens, return_hidden=True).hidden
        ref = mtp_forward(params, cfg, hidden, tokens)
        pos = jnp.arange(12, dtype=jnp.int32)[None]
        seg = jnp.zeros((1, 12), jnp.int32)
        h, ours = hidden, []
        for d in range(1, cfg.num_mtp_modules + 1):
            nxt = jnp.pad(tokens[:, d:], ((0, 0), (0, d)))
            # the drafter's form: stacked modules, traced depth
            h, logits = mtp_depth(params, cfg, jnp.int32(d), h, nxt, pos, seg, mtp=stack_mtp(params))
            ours.append(logits)
        return ours, ref

    ours, ref = both(params, tokens)
    for d in range(cfg.num_mtp_modules):
        np.testing.assert_allclose(np.asarray(ours[d]), np.asarray(ref[d]), rtol=1e-5, atol=1e-5)


def test_random_mtp_speculative_greedy_equals_plain_greedy(m2_mtp):
    cfg, params = m2_mtp
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, cfg.vocab_size, 9).tolist(), rng.integers(3, cfg.vocab_size, 4).tolist()]
    gen = Generator(cfg, params, engine="recompute")
    # 9 + 20 tokens + 3 drafts fit one padded length (32) of the recompute engine: one compilation
    plain = gen.generate(prompts, GenerationConfig(max_new_tokens=20, stop_token_ids=()))
    spec = gen.generate(prompts, GenerationConfig(max_new_tokens=20, stop_token_ids=(), speculative="mtp"))
    assert [s.tokens for s in spec.sequences] == [s.tokens for s in plain.sequences]
    st = spec.stats
    assert st.drafted > 0 and st.acceptance_rate is not None and 0 <= st.acceptance_rate < 0.5
    assert "speculative mtp: accepted" in st.summary()


def test_paged_engine_speculative_or_clear_error(m2_mtp):
    cfg, params = m2_mtp
    from minimax_jax.infer.backends import PagedBackend

    gen = Generator(cfg, params)               # paged
    prompt = [[5, 6, 7, 8]]
    if not PagedBackend.engine_returns_hidden():
        # fails at once, before any compute, and says why
        with pytest.raises(EngineUnavailable, match="does not return hidden states"):
            gen.generate(prompt, GenerationConfig(max_new_tokens=8, stop_token_ids=(), speculative="mtp"))
        return
    plain = gen.generate(prompt, GenerationConfig(max_new_tokens=8, stop_token_ids=()))
    spec = gen.generate(prompt, GenerationConfig(max_new_tokens=8, stop_token_ids=(), speculative="mtp"))
    assert spec.sequences[0].tokens == plain.sequences[0].tokens
