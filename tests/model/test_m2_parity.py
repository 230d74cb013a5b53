"""MiniMax-M2 forward parity with HF transformers ``MiniMaxM2ForCausalLM`` (float32, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.convert.from_state import params_from_hf_state
from minimax_jax.model import forward
from tests import hf_fixtures as hf

jax.config.update("jax_default_matmul_precision", "highest")

CONFIGS = [
    dict(seed=0),  # 6 heads over 2 kv heads, rotary_dim 4 < head_dim 8, 5 experts top-3
    dict(seed=1, layers=3, heads=4, kv=4, head_dim=16, rotary_dim=16, experts=4, top_k=1),
    dict(seed=2, layers=1, heads=8, kv=1, head_dim=8, rotary_dim=2, experts=7, top_k=7, hidden=24, inter=8),
    dict(seed=3, layers=2, heads=6, kv=3, head_dim=12, rotary_dim=6, experts=6, top_k=2, native_rope=True),
]


def _ours(model):
    cfg = ModelConfig.from_hf_config(model.config.to_dict(), dtype="float32", param_dtype="float32")
    return cfg, params_from_hf_state(hf.state_of(model), cfg)


@pytest.mark.parametrize("spec", CONFIGS, ids=lambda s: f"seed{s['seed']}")
@pytest.mark.parametrize("seq_len", [1, 17, 257])
def test_logits_match_hf(spec, seq_len):
    hf.require_hf()
    model = hf.m2_model(**spec)
    cfg, params = _ours(model)
    rng = np.random.default_rng(spec["seed"] * 100 + seq_len)
    tokens = rng.integers(0, cfg.vocab_size, (2, seq_len)).astype(np.int32)
    ref = hf.hf_logits(model, tokens)
    got = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t).logits)(params, jnp.asarray(tokens)))
    rel = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert rel <= 1e-5, f"max relative error {rel:.3g}"


def test_batch_of_different_lengths_right_padded():
    """Batch 2 with lengths 17 and 9: right padding, the padded tail marked by segment id -1... the
    valid part must equal HF run on each row alone."""
    hf.require_hf()
    model = hf.m2_model(seed=4)
    cfg, params = _ours(model)
    rng = np.random.default_rng(4)
    lens = [17, 9]
    tokens = rng.integers(0, cfg.vocab_size, (2, 17)).astype(np.int32)
    seg = np.zeros((2, 17), np.int32)
    seg[1, lens[1]:] = 1  # padding forms its own segment and never leaks into the real tokens
    got = np.asarray(forward(params, cfg, jnp.asarray(tokens), segment_ids=jnp.asarray(seg)).logits)
    for b, n in enumerate(lens):
        ref = hf.hf_logits(model, tokens[b:b + 1, :n])[0]
        rel = np.max(np.abs(got[b, :n] - ref)) / np.max(np.abs(ref))
        assert rel <= 1e-5, f"row {b}: {rel:.3g}"


def test_greedy_32_tokens_identical():
    hf.require_hf()
    import torch

    model = hf.m2_model(seed=5)
    cfg, params = _ours(model)
    prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, (1, 7)).astype(np.int32)
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=32).numpy()[0, 7:]
    total = 7 + 32
    # One compiled shape: the sequence is right-padded to its final length; causal attention means
    # the padding never influences the logits at position n - 1.
    step = jax.jit(lambda p, t, n: jnp.argmax(forward(p, cfg, t).logits[0, n - 1]))
    toks = list(prompt[0])
    for _ in range(32):
        padded = np.zeros((1, total), np.int32)
        padded[0, :len(toks)] = toks
        toks.append(int(step(params, jnp.asarray(padded), len(toks))))
    assert toks[7:] == list(ref)
