"""Shared fixtures of the decode tests (no tests here): small float32 models and a jitted full-sequence reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.model.params import init_params
from minimax_jax.model.transformer import forward

ATOL = 1e-4
REF_LEN = 192          # references are computed on tokens right-padded to this length (causal: exact)


@functools.lru_cache(maxsize=None)
def small_model(kind: str):
    """2-layer float32 models: "m3" = dense layer + MSA/MoE layer (block 16, top-4), "m2" = 2 dense-attention MoE layers."""
    if kind == "m3":
        cfg = ModelConfig.from_yaml("configs/tiny-m3.yaml").replace(
            num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "moe"), num_mtp_modules=0)
    else:
        cfg = ModelConfig.from_yaml("configs/tiny-m2.yaml").replace(num_layers=2, layer_types=("full", "full"),
                                                                    mlp_types=("moe", "moe"))
    return cfg, init_params(cfg, jax.random.PRNGKey(7))


@functools.partial(jax.jit, static_argnums=1)
def _fwd(params, cfg, tokens):
    return forward(params, cfg, tokens).logits


def reference_logits(cfg, params, tokens) -> np.ndarray:
    """``forward`` logits ``[len(tokens), V]`` (one compile per config: inputs padded to REF_LEN)."""
    n = len(tokens)
    assert n <= REF_LEN
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, :n] = tokens
    return np.asarray(_fwd(params, cfg, jnp.asarray(padded)))[0, :n]


def random_tokens(rng, cfg, n):
    return [int(t) for t in rng.integers(3, cfg.vocab_size, n)]


def assert_close(got, want):
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
