"""TPU (Mosaic) indexer-KL kernels (pallas_kernels/msa/tpu_kl.py) in Pallas interpret mode on CPU
against the FP32 XLA reference (minimax_jax.ops.msa.kl), seeded random inputs: loss, row count, d qi /
d ki (cosine and max error), zero cotangents for q and k, bitwise repeatability; the race-detecting
TPU interpreter on all three kernels; Mosaic lowering for TPU (jax.export, platforms=["tpu"]);
routing through minimax_jax.ops.msa (explicit and "auto" on a TPU) and the kernels' supports checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops.msa import pallas as msa_pallas
from minimax_jax.ops.registry import (ImplementationUnavailable, assume_backend, clear_implementation_report,
                                      get_op, implementation_report)
from pallas_kernels.msa import tpu_common
from pallas_kernels.msa.tpu_kl import indexer_kl_tpu
from tests.kernels.msa.test_msa_kernels_oracle import cosine, make_case, positions, random_ids
from tests.kernels.msa.test_msa_tpu_chunks import race_states

_F0 = np.zeros((), jax.dtypes.float0)


def _case(rng, *, bsz, t, s, h, g, d, di, topk, blk, segments=None, dtype=np.float32):
    c = make_case(rng, bsz=bsz, t=t, s=s, h=h, g=g, d=d, segments=segments)
    c["qi"] = rng.standard_normal((bsz, t, g, di)).astype(np.float32)
    c["ki"] = rng.standard_normal((bsz, s, di)).astype(np.float32)
    if dtype != np.float32:   # representable values, so both sides see the same inputs
        for n in ("q", "k", "qi", "ki"):
            c[n] = np.asarray(jnp.asarray(c[n], dtype).astype(jnp.float32))
    c["ids"] = random_ids(rng, c["q_pos"], c["q_seg"], g, topk, blk)
    return c


def _run(fn, c, blk, dtype=jnp.float32, ct=1.0):
    """(kl, count, (dq, dk, dqi, dki)) of fn(q, k, qi, ki, ids, ...) under jit."""
    pos = positions(c)
    ids = jnp.asarray(c["ids"])

    @jax.jit
    def f(q, k, qi, ki):
        (kl, cnt), vjp = jax.vjp(lambda *a: fn(*a, ids, block_size=blk, **pos), q, k, qi, ki)
        return kl, cnt, vjp((jnp.float32(ct), _F0))
    return f(*(jnp.asarray(c[n], dtype) for n in ("q", "k", "qi", "ki")))


def _xla(*a, **kw):
    return msa_ops.indexer_kl(*a, implementation="xla", **kw)


def _check(got, ref, *, kl_rtol, cos_min, err_rel):
    """Compare with the reference; returns (kl rel err, [(cos, max err / max |ref|)] of qi, ki)."""
    kl, cnt, g = got
    rkl, rcnt, rg = ref
    assert int(cnt) == int(rcnt)
    np.testing.assert_allclose(float(kl), float(rkl), rtol=kl_rtol)
    assert not np.any(np.asarray(g[0], np.float32)) and not np.any(np.asarray(g[1], np.float32))
    stats = []
    for a, b in zip(g[2:], rg[2:]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        cs, err = cosine(a, b), float(np.max(np.abs(a - b)) / np.abs(b).max())
        assert cs > cos_min, cs
        assert err <= err_rel, err
        stats.append((cs, err))
    return abs(float(kl) - float(rkl)) / abs(float(rkl)), stats


# Three scales: (packed segments, kv == q) / (queries a suffix of longer keys, chunked calls) /
# (larger heads per group with padded M rows, packed, two batch rows).
_SCALES = {
    "packed": dict(bsz=2, t=24, s=24, h=6, g=2, d=16, di=16, topk=3, blk=8,
                   segments=[[9, 12, 3], [24]]),
    "suffix": dict(bsz=1, t=12, s=50, h=4, g=1, d=16, di=32, topk=3, blk=8),
    "wide": dict(bsz=2, t=32, s=48, h=16, g=2, d=32, di=16, topk=4, blk=16,
                 segments=[[20, 28], [5, 43]]),
}


@pytest.mark.parametrize("scale", list(_SCALES))
def test_kl_fp32_matches_reference_and_is_deterministic(scale, monkeypatch):
    rng = np.random.default_rng(0)
    cfg = dict(_SCALES[scale])
    blk = cfg.pop("blk")
    c = _case(rng, blk=blk, **cfg)
    ct = float(rng.uniform(0.5, 2.0))
    if scale == "suffix":   # a small SMEM budget: query chunks of 5 tokens, d ki windows of 16
        monkeypatch.setattr(tpu_common, "TABLE_WORDS", 96)
    kern = lambda *a, **kw: indexer_kl_tpu(*a, interpret=True, **kw)  # noqa: E731
    got = _run(kern, c, blk, ct=ct)
    _check(got, _run(_xla, c, blk, ct=ct), kl_rtol=1e-4, cos_min=0.9999, err_rel=1e-4)
    again = _run(kern, c, blk, ct=ct)
    assert np.asarray(again[0]).tobytes() == np.asarray(got[0]).tobytes()
    for a, b in zip(again[2], got[2]):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_kl_bf16_tolerances():
    rng = np.random.default_rng(1)
    cfg = dict(_SCALES["packed"])
    blk = cfg.pop("blk")
    c = _case(rng, blk=blk, dtype=jnp.bfloat16, **cfg)
    kern = lambda *a, **kw: indexer_kl_tpu(*a, interpret=True, **kw)  # noqa: E731
    got = _run(kern, c, blk, dtype=jnp.bfloat16)
    assert got[2][2].dtype == jnp.bfloat16 and got[2][3].dtype == jnp.bfloat16
    _check(got, _run(_xla, c, blk), kl_rtol=2e-2, cos_min=0.99, err_rel=3e-2)


def test_kl_race_detection_all_kernels(monkeypatch):
    """TPU-semantics interpreter, detect_races=True, on fwd, d qi and d ki: no race, same values."""
    states = race_states(monkeypatch)
    rng = np.random.default_rng(2)
    c = _case(rng, bsz=1, t=10, s=24, h=4, g=2, d=16, di=16, topk=2, blk=8, segments=[[5, 17, 2]])
    params = pltpu.InterpretParams(detect_races=True)
    kern = lambda *a, **kw: indexer_kl_tpu(*a, interpret=params, **kw)  # noqa: E731
    got = jax.block_until_ready(_run(kern, c, 8))
    assert len(states) == 3                      # one per kernel: fwd, d qi, d ki
    assert not any(s.races_found for s in states)
    _check(got, _run(_xla, c, 8), kl_rtol=1e-4, cos_min=0.9999, err_rel=1e-4)


@pytest.mark.parametrize("h,g", [(16, 2), (12, 2)])   # 8 heads per group; 6 (padded to 8 rows)
def test_kl_fwd_and_grad_lower_for_tpu(h, g):
    sd = jax.ShapeDtypeStruct
    b, t, s, d, di, k = 1, 256, 1024, 128, 128, 4
    args = (sd((b, t, h, d), jnp.bfloat16), sd((b, s, g, d), jnp.bfloat16),
            sd((b, t, g, di), jnp.bfloat16), sd((b, s, di), jnp.bfloat16),
            sd((b, g, t, k), jnp.int32), sd((b, t), jnp.int32), sd((b, s), jnp.int32),
            sd((b, t), jnp.int32), sd((b, s), jnp.int32))

    def f(q, kk, qi, ki, ids, qp, kp, qs, ks):
        def loss(qi, ki):
            return indexer_kl_tpu(q, kk, qi, ki, ids, q_positions=qp, kv_positions=kp,
                                  q_segment_ids=qs, kv_segment_ids=ks, block_size=128)[0]
        return jax.value_and_grad(loss, argnums=(0, 1))(qi, ki)
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") >= 3            # fwd, d qi, d ki
    for name in ("msa_kl_fwd_tpu", "msa_kl_dqi_tpu", "msa_kl_dki_tpu"):
        assert name in text


def test_kl_through_op_and_auto_on_tpu(monkeypatch):
    rng = np.random.default_rng(3)
    cfg = dict(_SCALES["packed"])
    blk = cfg.pop("blk")
    c = _case(rng, blk=blk, **cfg)
    op = lambda impl: (lambda *a, **kw: msa_ops.indexer_kl(*a, implementation=impl, **kw))  # noqa
    clear_implementation_report()
    got = _run(op("pallas_tpu_interpret"), c, blk)
    assert implementation_report()["indexer_kl"] == "pallas_tpu_interpret"
    ref = _run(_xla, c, blk)
    _check(got, ref, kl_rtol=1e-4, cos_min=0.9999, err_rel=1e-4)

    # "auto" on a TPU picks the TPU kernel (run here in interpret mode in place of Mosaic); the
    # TPU kernels take block_size % 128 == 0 only, so this case uses 128-token blocks.
    c = _case(rng, bsz=1, t=8, s=300, h=4, g=2, d=16, di=16, topk=2, blk=128)
    blk = 128
    ref = _run(_xla, c, blk)
    seen = []

    def spy(*a, interpret, **kw):
        seen.append(interpret)
        return indexer_kl_tpu(*a, interpret=True, **kw)
    monkeypatch.setattr(msa_pallas, "indexer_kl_tpu", spy)
    clear_implementation_report()
    with assume_backend("tpu"):
        kl, cnt = jax.jit(lambda q, k, qi, ki: msa_ops.indexer_kl(q, k, qi, ki, c["ids"], block_size=blk,
                                                                  implementation="auto", **positions(c))
                          )(c["q"], c["k"], c["qi"], c["ki"])
    assert seen == [False] and implementation_report()["indexer_kl"] == "pallas_tpu"
    assert int(cnt) == int(ref[1])
    np.testing.assert_allclose(float(kl), float(ref[0]), rtol=1e-4)


def test_kl_supports_and_unavailable_paths():
    sd = jnp.zeros
    q, k = sd((1, 256, 2, 16)), sd((1, 256, 2, 16))
    qi, ki = sd((1, 256, 2, 16)), sd((1, 256, 16))
    ids = jnp.zeros((1, 2, 256, 1), jnp.int32)
    pos = dict(q_positions=jnp.arange(256)[None], kv_positions=jnp.arange(256)[None])
    supports = get_op("indexer_kl").implementations["pallas_tpu"].supports
    assert supports(q, k, qi, ki, ids, block_size=128, **pos) is None
    assert "128" in supports(q, k, qi, ki, ids, block_size=64, **pos)
    assert "dense" in supports(q, k, qi, ki, None, block_size=128, **pos)
    with pytest.raises(ValueError, match="dense warm-up"):
        indexer_kl_tpu(q, k, qi, ki, None, block_size=128, **pos)
    with pytest.raises(ImplementationUnavailable, match="dense warm-up"):
        msa_ops.indexer_kl(q, k, qi, ki, None, block_size=128, implementation="pallas_tpu_interpret", **pos)
    with pytest.raises(AssertionError, match="multiple of 8"):
        indexer_kl_tpu(q, k, qi, ki, ids, block_size=12, **pos)
    with pytest.raises(AssertionError, match="qi shape"):
        indexer_kl_tpu(q, k, qi[:, :, :1], ki, ids, block_size=128, **pos)
