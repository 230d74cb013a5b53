"""The banded sliding-window attention path (``implementation="xla_banded"``) against the plain
XLA reference: packed rows, several window / chunk sizes, outputs and gradients, every element."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import registry
from minimax_jax.ops.attention import attention, flash
from minimax_jax.ops.registry import ImplementationUnavailable, clear_implementation_report, implementation_report


def _packed(b, t, seed):
    rng = np.random.default_rng(seed)
    pos = np.zeros((b, t), np.int32)
    seg = np.full((b, t), -1, np.int32)
    for r in range(b):
        o, i = 0, 0
        while o < t - 3:
            n = int(rng.integers(3, max(4, t // 2)))
            n = min(n, t - 3 - o) if rng.random() < 0.9 else min(n, t - o)
            pos[r, o:o + n] = np.arange(n)
            seg[r, o:o + n] = i
            o, i = o + n, i + 1
    return jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("t,window,chunk", [(97, 16, 32), (128, 40, 32), (64, 100, 16), (50, 7, 64)])
def test_banded_equals_reference(t, window, chunk):
    b, h, g, d = 2, 4, 2, 16
    ks = jax.random.split(jax.random.key(t * 1000 + window), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, g, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, g, d), jnp.float32)
    do = jax.random.normal(ks[3], (b, t, h, d), jnp.float32)
    pos, seg = _packed(b, t, seed=t + window)

    def f(impl):
        def loss(q, k, v):
            o = attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                          sliding_window=window, implementation=impl, chunk_size=chunk)
            return jnp.sum(o * do), o
        # a fresh jit per call: traced anew (the report is recorded), compiled once instead of per op
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return o, grads

    clear_implementation_report()
    o_b, g_b = f("xla_banded")
    assert implementation_report()["attention"] == "xla_banded"
    o_r, g_r = f("xla")
    np.testing.assert_allclose(np.asarray(o_b), np.asarray(o_r), atol=2e-5, rtol=2e-5)
    for a, r in zip(g_b, g_r):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=5e-5, rtol=5e-5)


def test_auto_picks_banded_only_when_it_applies():
    b, t, h, g, d = 1, 40, 2, 1, 8
    q = jnp.ones((b, t, h, d))
    k = v = jnp.ones((b, t, g, d))
    pos = jnp.arange(t)[None]
    clear_implementation_report()
    attention(q, k, v, q_positions=pos, kv_positions=pos, sliding_window=8, implementation="auto")
    assert implementation_report()["attention"] == "xla_banded"
    clear_implementation_report()
    attention(q, k, v, q_positions=pos, kv_positions=pos + 0, sliding_window=8, implementation="auto")
    assert implementation_report()["attention"] == "xla"        # two position arrays: not provably banded
    with pytest.raises(ImplementationUnavailable, match="sliding window"):
        attention(q, k, v, q_positions=pos, kv_positions=pos, implementation="xla_banded")


def test_auto_on_gpu_picks_flash_for_packed_rows(monkeypatch):
    """``"auto"`` routing on a GPU backend (the kernel itself is replaced: CPU here)."""
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, seg, backend: jnp.zeros_like(q))
    monkeypatch.setattr(registry, "default_backend", lambda: "gpu")
    b, t, h, g, d = 1, 32, 2, 1, 16
    q = jnp.ones((b, t, h, d))
    k = v = jnp.ones((b, t, g, d))
    pos = jnp.arange(t)[None]
    seg = jnp.zeros((b, t), jnp.int32)
    clear_implementation_report()
    attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
              implementation="auto")
    assert implementation_report()["attention"] == "pallas_flash_gpu"
    clear_implementation_report()   # positions that decrease inside a segment: the kernels would mask wrongly
    bad = jnp.asarray(np.r_[np.arange(16), np.arange(16)[::-1]][None], jnp.int32)
    attention(q, k, v, q_positions=bad, kv_positions=bad, q_segment_ids=seg, kv_segment_ids=seg,
              implementation="auto")
    assert implementation_report()["attention"] == "xla"


@pytest.mark.parametrize("case", ["segments", "suffix", "window"])
def test_cudnn_refuses_what_its_causal_mask_cannot_express(case, monkeypatch):
    """implementation="cudnn" masks by storage index: packed segment ids, queries that are a suffix of the
    keys (T != S) or a sliding window must raise (it would silently attend across documents otherwise),
    even where a GPU backend is present."""
    monkeypatch.setattr(registry, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(0)
    b, t, h, g, d = 1, 16, 4, 2, 8
    s = t + 4 if case == "suffix" else t
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, g, d)), jnp.float32)
    kw = dict(q_positions=jnp.arange(s - t, s, dtype=jnp.int32)[None], kv_positions=jnp.arange(s, dtype=jnp.int32)[None])
    if case == "segments":
        seg = jnp.asarray((np.arange(t) >= 7).astype(np.int32))[None]
        kw.update(q_segment_ids=seg, kv_segment_ids=seg)
    if case == "window":
        kw.update(sliding_window=4)
    with pytest.raises(ImplementationUnavailable, match="plain causal"):
        attention(q, k, k, implementation="cudnn", **kw)
