"""Unit tests for norms, RoPE, routing, GQA attention masks and dtype policy (chex)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import load_config
from minimax_jax.model import forward, init_params
from minimax_jax.model.layers import apply_rope, rms_norm, rope_frequencies, swiglu
from minimax_jax.ops.attention import attention
from minimax_jax.ops.moe import moe_experts, route

jax.config.update("jax_default_matmul_precision", "highest")


def test_rms_norm_kinds():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 16)).astype(np.float32)
    w = rng.normal(size=16).astype(np.float32)
    xhat = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, kind="rms"), xhat * w, rtol=1e-5)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, kind="gemma"), xhat * (1 + w),
                               rtol=1e-5)
    y = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), eps=1e-6, kind="rms")
    assert y.dtype == jnp.bfloat16


def test_rope_partial_neox_against_numpy():
    rng = np.random.default_rng(1)
    b, t, h, d, r, theta = 2, 7, 3, 12, 8, 1e4
    x = rng.normal(size=(b, t, h, d)).astype(np.float32)
    pos = rng.integers(0, 1000, (b, t)).astype(np.int32)
    cos, sin = rope_frequencies(jnp.asarray(pos), r, theta)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv = theta ** (-np.arange(0, r, 2) / r)
    ref = x.copy()
    for i in range(r // 2):  # pair (i, i + r/2) rotates by angle pos * inv[i]
        ang = pos[..., None] * inv[i]
        a, c = x[..., i], x[..., i + r // 2]
        ref[..., i] = a * np.cos(ang) - c * np.sin(ang)
        ref[..., i + r // 2] = c * np.cos(ang) + a * np.sin(ang)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[..., r:], x[..., r:])  # pass-through dims untouched


def test_rope_relative_property():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)

    def dot(pq, pk):
        cq, sq = rope_frequencies(jnp.array([[pq]]), 8, 1e4)
        ck, sk = rope_frequencies(jnp.array([[pk]]), 8, 1e4)
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert math.isclose(dot(10, 3), dot(107, 100), rel_tol=1e-4)


def test_routing_bias_only_chooses_and_ties_go_to_lower_id():
    x = jnp.ones((1, 2), jnp.float32)
    router = jnp.zeros((2, 4), jnp.float32)          # all sigmoid scores equal 0.5: a 4-way tie
    w, e, load = route(x, router, jnp.zeros(4), 2)
    assert e.tolist() == [[0, 1]]                     # ties -> lower expert id
    bias = jnp.array([0.0, 0.0, 1.0, 2.0])
    w, e, load = route(x, router, bias, 2)
    assert sorted(e[0].tolist()) == [2, 3]            # bias changes the choice...
    np.testing.assert_allclose(w, [[0.5, 0.5]])       # ...but not the weights (renormalised scores)
    assert load.tolist() == [0, 0, 1, 1]


def test_routing_weights_against_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 8)).astype(np.float32)
    r = rng.normal(size=(8, 5)).astype(np.float32)
    b = rng.normal(size=5).astype(np.float32) * 0.1
    w, e, _ = route(jnp.asarray(x), jnp.asarray(r), jnp.asarray(b), 3)
    s = 1 / (1 + np.exp(-(x @ r)))
    for n in range(6):
        chosen = np.argsort(-(s[n] + b), kind="stable")[:3]
        assert set(e[n].tolist()) == set(chosen.tolist())
        np.testing.assert_allclose(np.asarray(w[n]), s[n, np.asarray(e[n])] / s[n, np.asarray(e[n])].sum(),
                                   rtol=1e-5)


@pytest.mark.parametrize("impl", ["xla_dense", "xla_ragged"])
def test_moe_implementations_match_loop(impl):
    cfg = load_config("tiny-m2")
    rng = np.random.default_rng(4)
    n, h, e, i, k = 11, 8, 5, 6, 3
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    wi = jnp.asarray(rng.normal(size=(e, h, 2 * i)), jnp.float32)
    wo = jnp.asarray(rng.normal(size=(e, i, h)), jnp.float32)
    w, ex, _ = route(x, jnp.asarray(rng.normal(size=(h, e)), jnp.float32), jnp.zeros(e), k)
    act = lambda g: swiglu(g, cfg)  # noqa: E731
    got = moe_experts(x, w, ex, wi, wo, act, implementation=impl)
    ref = np.zeros((n, h), np.float32)
    for t in range(n):
        for j in range(k):
            eid = int(ex[t, j])
            ref[t] += float(w[t, j]) * np.asarray(act(x[t] @ wi[eid]) @ wo[eid])
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def _naive_attention(q, k, v, mask):
    b, t, h, d = q.shape
    g = k.shape[2]
    kk = np.repeat(k, h // g, axis=2)
    vv = np.repeat(v, h // g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(d)
    s = np.where(mask[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    return np.einsum("bhts,bshd->bthd", p, vv)


@pytest.mark.parametrize("window", [None, 5])
def test_gqa_attention_masks_segments_suffix(window):
    rng = np.random.default_rng(5)
    b, t, s, h, g, d = 2, 6, 19, 6, 2, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k = rng.normal(size=(b, s, g, d)).astype(np.float32)
    v = rng.normal(size=(b, s, g, d)).astype(np.float32)
    kv_pos = np.tile(np.arange(s), (b, 1)).astype(np.int32)
    q_pos = kv_pos[:, -t:]                                     # queries are a suffix of the keys
    kv_seg = np.zeros((b, s), np.int32)
    kv_seg[1, :8] = 1                                          # row 1: an earlier document
    q_seg = kv_seg[:, -t:]
    mask = (kv_pos[:, None] <= q_pos[:, :, None]) & (kv_seg[:, None] == q_seg[:, :, None])
    if window:
        mask &= (q_pos[:, :, None] - kv_pos[:, None]) < window
    got = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
                    kv_positions=jnp.asarray(kv_pos), q_segment_ids=jnp.asarray(q_seg),
                    kv_segment_ids=jnp.asarray(kv_seg), sliding_window=window, chunk_size=4)
    chex.assert_shape(got, (b, t, h, d))
    np.testing.assert_allclose(np.asarray(got), _naive_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_bf16_forward_within_bf16_tolerance_of_fp32():
    cfg32 = load_config("tiny-m2")
    cfg16 = cfg32.replace(dtype="bfloat16")
    params = init_params(cfg32, jax.random.key(0))
    # Default init (std 0.02). Larger weights make routing decisions flip between dtypes, which is a
    # discrete change, not rounding; bf16's 8-bit mantissa gives ~0.4% per op.
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg32.vocab_size)
    a = forward(params, cfg32, tokens).logits
    b = forward(params, cfg16, tokens).logits
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)  # logits are float32 in both
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
    assert 0 < rel < 3e-2, rel


def test_forward_jit_and_scan_compile_once_per_segment():
    cfg = load_config("tiny-m3")
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((1, 40), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: forward(p, cfg, t).logits)(params, tokens)
    assert str(jaxpr).count("scan[") >= 2  # one scan per segment, not one body per layer
