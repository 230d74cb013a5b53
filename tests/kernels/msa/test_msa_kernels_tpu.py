"""TPU (Mosaic) MSA kernels in Pallas interpret mode on CPU, through minimax_jax.ops.msa
(implementation="pallas_tpu_interpret"), against the XLA reference; seeded random inputs; every element.
One test runs the TPU-semantics interpreter with race detection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from pallas_kernels.msa.tpu_attention import msa_attention_tpu
from tests.kernels.msa.test_msa_kernels_oracle import cosine, id_sets, make_case, positions, random_ids

BLK = 8


def _grads(impl, c, ids, dtype):
    pos = positions(c)
    q, k, v = (jnp.asarray(c[n], dtype) for n in ("q", "k", "v"))

    @jax.jit
    def f(q, k, v):
        def fwd(q, k, v):
            return msa_ops.msa_attention(q, k, v, jnp.asarray(ids), block_size=BLK,
                                         implementation=impl, **pos)
        (o, lse), vjp = jax.vjp(fwd, q, k, v)
        return o, lse, vjp((jnp.asarray(c["do"], o.dtype), jnp.zeros_like(lse)))
    return f(q, k, v)


def _op(fn, **kw):
    """``fn(*arrays, **kw)`` under jit (one compile instead of one per op; array keywords become
    constants)."""
    return jax.jit(lambda *a: fn(*a, **kw))


def test_attention_packed_matches_reference_and_reports():
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=2, t=28, s=28, h=6, g=2, d=16, segments=[[11, 13, 2], [28]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    clear_implementation_report()
    o, lse, grads = _grads("pallas_tpu_interpret", c, ids, jnp.float32)
    assert implementation_report()["msa_attention"] == "pallas_tpu_interpret"
    ro, rlse, rgrads = _grads("xla", c, ids, jnp.float32)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=1e-5)
    for a, b in zip(grads, rgrads):
        a, b = np.asarray(a), np.asarray(b)
        assert cosine(a, b) > 0.9999
        assert np.max(np.abs(a - b)) <= 1e-4 * np.abs(b).max()


def test_attention_suffix_bf16_tolerances():
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=1, t=10, s=50, h=4, g=1, d=16, dtype=np.float32)
    for n in ("q", "k", "v"):   # bf16-representable inputs so both sides see the same values
        c[n] = np.asarray(jnp.asarray(c[n], jnp.bfloat16).astype(jnp.float32))
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 1, 3, BLK)
    o, lse, grads = _grads("pallas_tpu_interpret", c, ids, jnp.bfloat16)
    ro, rlse, rgrads = _grads("xla", c, ids, jnp.float32)
    o, ro = np.asarray(o, np.float32), np.asarray(ro)
    assert np.all(np.abs(o - ro) <= 3e-2 + 3e-2 * np.abs(ro))
    assert np.max(np.abs(np.asarray(lse) - np.asarray(rlse))) <= 1e-3
    for a, b in zip(grads, rgrads):
        assert cosine(a, b) > 0.99


@pytest.mark.parametrize("init_blocks,local_blocks,segments", [
    (0, 1, [[17, 20, 3], [40]]), (1, 2, None)])
def test_select_blocks_sets_match_reference(init_blocks, local_blocks, segments):
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=2, t=40, s=40, h=2, g=2, d=8, segments=segments)
    qi = rng.standard_normal((2, 40, 2, 16)).astype(np.float32)
    ki = rng.standard_normal((2, 40, 16)).astype(np.float32)
    kw = dict(block_size=BLK, topk=4, init_blocks=init_blocks, local_blocks=local_blocks,
              **positions(c))
    got = _op(msa_ops.msa_select_blocks, implementation="pallas_tpu_interpret", **kw)(qi, ki)
    ref = _op(msa_ops.msa_select_blocks, implementation="xla", **kw)(qi, ki)
    assert id_sets(np.asarray(got)) == id_sets(np.asarray(ref))
    local = c["q_pos"] // BLK
    for (b, r, i), st in id_sets(np.asarray(got)).items():
        if c["q_seg"][b, i] >= 0:
            assert local[b, i] in st
    if init_blocks == 0 and local_blocks == 1:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.slow   # also run by default in tests/kernels/msa/test_msa_kernels_tpu_layouts.py
def test_forward_with_race_detection():
    """TPU-semantics interpreter with detect_races=True: no race reported, same result."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=6, s=24, h=2, g=1, d=8)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 1, 2, BLK)
    o, _ = msa_attention_tpu(jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]),
                             jnp.asarray(ids), block_size=BLK,
                             interpret=pltpu.InterpretParams(detect_races=True), **positions(c))
    o = jax.block_until_ready(o)
    races = mosaic_interpret.races   # RaceDetectionState of the last interpreted kernel
    assert races is not None and not races.races_found
    ro, _ = _op(msa_ops.msa_attention, block_size=BLK, implementation="xla", **positions(c))(
        c["q"], c["k"], c["v"], ids)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("s", [1, 127, 128, 129, 2047, 2048, 2049, 2304])
def test_length_cases_block128_top16(s):
    """MSA_SPEC length cases (B=128, K=16) on the TPU kernels: selection SETS and attention."""
    rng = np.random.default_rng(4)
    t = min(s, 8)
    c = make_case(rng, bsz=1, t=t, s=s, h=2, g=1, d=16)
    qi = rng.standard_normal((1, t, 1, 16)).astype(np.float32)
    ki = rng.standard_normal((1, s, 16)).astype(np.float32)
    kw = dict(block_size=128, topk=16, **positions(c))
    ids = msa_ops.msa_select_blocks(qi, ki, implementation="pallas_tpu_interpret", **kw)
    ref = msa_ops.msa_select_blocks(qi, ki, implementation="xla", **kw)
    assert id_sets(np.asarray(ids)) == id_sets(np.asarray(ref))
    akw = dict(block_size=128, **positions(c))
    o, lse = msa_ops.msa_attention(c["q"], c["k"], c["v"], ids, implementation="pallas_tpu_interpret",
                                   **akw)
    ro, rlse = msa_ops.msa_attention(c["q"], c["k"], c["v"], ids, implementation="xla", **akw)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=1e-5)


@pytest.mark.slow   # also run by default in tests/kernels/msa/test_msa_kernels_tpu_layouts.py
def test_decode_like_layout_queries_not_at_the_end():
    """Gathered cache layout (kv_pos = arange(S), future slots unwritten, queries anywhere)."""
    rng = np.random.default_rng(5)
    c = make_case(rng, bsz=1, t=3, s=48, h=2, g=1, d=8)
    c["q_pos"] = np.array([[9, 30, 0]], np.int32)
    c["q_seg"] = np.array([[0, 0, 1]], np.int32)            # last row: padding, sees nothing
    qi = rng.standard_normal((1, 3, 1, 16)).astype(np.float32)
    ki = rng.standard_normal((1, 48, 16)).astype(np.float32)
    kw = dict(block_size=BLK, **positions(c))
    ids = _op(msa_ops.msa_select_blocks, topk=3, implementation="pallas_tpu_interpret", **kw)(qi, ki)
    ref = _op(msa_ops.msa_select_blocks, topk=3, implementation="xla", **kw)(qi, ki)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref))
    o, lse = _op(msa_ops.msa_attention, implementation="pallas_tpu_interpret", **kw)(c["q"], c["k"], c["v"], ids)
    ro, rlse = _op(msa_ops.msa_attention, implementation="xla", **kw)(c["q"], c["k"], c["v"], ids)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(rlse)))
