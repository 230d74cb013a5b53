"""GPU (Triton-lowered) MSA kernels, run in Pallas interpret mode on CPU, against the references.

Oracles: minimax_jax.ops.msa implementation="xla" (the project's FP32 reference) and the dense
fp64 oracle in tests/kernels/msa/test_msa_kernels_oracle.py. Seeded random inputs; every element is
compared. A cuda-lowering test checks that the kernels lower for the GPU on this CPU machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops.registry import (ImplementationUnavailable, clear_implementation_report, get_op,
                                      implementation_report)
from pallas_kernels.msa.gpu_attention import msa_attention_gpu
from pallas_kernels.msa.gpu_indexer import msa_select_blocks_gpu
from tests.kernels.msa.test_msa_kernels_oracle import (attention, cosine, id_sets, make_case, positions,
                                           random_ids)

BLK = 16
slow = pytest.mark.slow


def _assert_grads_close(a, b, cos_min, rel_max):
    """Cosine > cos_min and max |a-b| <= rel_max * max|b|; an all-zero reference (e.g. a single
    visible key: softmax gradient is exactly 0) requires an all-(near)-zero result."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max()
    if scale < 1e-6:
        assert np.abs(a).max() < 1e-5
        return
    assert cosine(a, b) > cos_min
    assert np.max(np.abs(a - b)) <= rel_max * scale


def _run_attention(c, ids, dtype, repeats=1):
    """Kernel o, lse and (dq, dk, dv) for cotangent c["do"]; repeats > 1 re-runs the same
    compiled function and returns a list (for bitwise-determinism checks)."""
    pos = positions(c)
    q, k, v = (jnp.asarray(c[n], dtype) for n in ("q", "k", "v"))
    do = jnp.asarray(c["do"], dtype)
    ids = jnp.asarray(ids)

    @jax.jit
    def f(q, k, v):
        (o, lse), vjp = jax.vjp(lambda q, k, v: msa_attention_gpu(
            q, k, v, ids, block_size=BLK, interpret=True, **pos), q, k, v)
        return o, lse, vjp((do, jnp.zeros_like(lse)))
    if repeats > 1:
        return [f(q, k, v) for _ in range(repeats)]
    return f(q, k, v)


def _reference(c, ids):
    pos = positions(c)
    q, k, v = (jnp.asarray(c[n], jnp.float32) for n in ("q", "k", "v"))
    if c["v"].shape[-1] != c["q"].shape[-1]:
        # minimax_jax.ops.msa.reference reshapes o with D instead of Dv (reported to its owner):
        # use this file's own dense jnp oracle for the Dv != D case.
        from tests.kernels.msa.test_msa_kernels_oracle import attention_jnp, selected_mask, visible
        vis = jnp.asarray(visible(c["q_pos"], c["kv_pos"], c["q_seg"], c["kv_seg"])[:, None]
                          & selected_mask(ids, c["kv_pos"], BLK))
        _, rlse = attention(c["q"], c["k"], c["v"], ids, c["q_pos"], c["kv_pos"], c["q_seg"],
                            c["kv_seg"], BLK)
        o = attention_jnp(q, k, v, vis)
        g = jax.grad(lambda q, k, v: jnp.sum(attention_jnp(q, k, v, vis) * c["do"]),
                     argnums=(0, 1, 2))(q, k, v)
        return o, rlse, g

    def loss(q, k, v):
        o, _ = msa_ops.msa_attention(q, k, v, jnp.asarray(ids), block_size=BLK,
                                     implementation="xla", **pos)
        return jnp.sum(o * jnp.asarray(c["do"]))

    @jax.jit    # one compile instead of one per op
    def ref(q, k, v):
        o, lse = msa_ops.msa_attention(q, k, v, jnp.asarray(ids), block_size=BLK,
                                       implementation="xla", **pos)
        return o, lse, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return ref(q, k, v)


def _select_gpu(qi, ki, **kw):
    """msa_select_blocks_gpu in interpret mode under jit (array keywords become constants)."""
    return jax.jit(lambda qi, ki: msa_select_blocks_gpu(qi, ki, interpret=True, **kw))(qi, ki)


CASES = {
    # name: (make_case kwargs, topk)
    "self_unpacked": (dict(bsz=1, t=96, s=96, h=4, g=2, d=16), 3),
    "suffix": (dict(bsz=1, t=20, s=150, h=4, g=1, d=16), 4),
    "packed_unaligned_tail_empty": (dict(bsz=2, t=72, s=72, h=6, g=2, d=16,
                                         segments=[[21, 30, 13], [72]]), 3),
    "dv_differs": (dict(bsz=1, t=40, s=70, h=2, g=2, d=32, dv=16), 3),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n.startswith("packed") else slow)
                                  for n in sorted(CASES)])
def test_attention_fp32_matches_reference(name):
    kw, topk = CASES[name]
    rng = np.random.default_rng(0)
    c = make_case(rng, **kw)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], kw["g"], topk, BLK)
    o, lse, grads = _run_attention(c, ids, jnp.float32)
    ro, rlse, rgrads = _reference(c, ids)
    assert np.isfinite(np.asarray(o)).all()
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=1e-5)
    for a, b in zip(grads, rgrads):
        _assert_grads_close(a, b, 0.9999, 1e-4)
    # the independent dense fp64 oracle as well (forward)
    o64, _ = attention(c["q"], c["k"], c["v"], ids, c["q_pos"], c["kv_pos"], c["q_seg"],
                       c["kv_seg"], BLK)
    np.testing.assert_allclose(np.asarray(o), o64, atol=2e-5, rtol=2e-5)


@slow   # also run by default in tests/kernels/msa/test_msa_kernels_gpu_bf16.py
def test_attention_bf16_tolerances_and_determinism():
    kw, topk = CASES["packed_unaligned_tail_empty"]
    rng = np.random.default_rng(1)
    c = make_case(rng, **kw)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], kw["g"], topk, BLK)
    (o, lse, grads), (o2, lse2, grads2) = _run_attention(c, ids, jnp.bfloat16, repeats=2)
    for a, b in zip((o, lse) + tuple(grads), (o2, lse2) + tuple(grads2)):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)   # bitwise repeat
    # reference on the same bf16-rounded inputs, in fp32
    cr = dict(c)
    for n in ("q", "k", "v"):
        cr[n] = np.asarray(jnp.asarray(c[n], jnp.bfloat16).astype(jnp.float32))
    ro, rlse, rgrads = _reference(cr, ids)
    o = np.asarray(o, np.float32)
    assert np.all(np.abs(o - np.asarray(ro)) <= 3e-2 + 3e-2 * np.abs(np.asarray(ro)))
    fin = np.isfinite(np.asarray(rlse))
    assert np.max(np.abs(np.asarray(lse)[fin] - np.asarray(rlse)[fin])) <= 1e-3
    for a, b in zip(grads, rgrads):
        _assert_grads_close(a, b, 0.99, 5e-2)


def _check_selection(ids, c, qi, ki, topk, init_blocks=0, local_blocks=1):
    ref = jax.jit(lambda qi, ki: msa_ops.msa_select_blocks(
        qi, ki, block_size=BLK, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
        implementation="xla", **positions(c)))(jnp.asarray(qi), jnp.asarray(ki))
    got, want = id_sets(np.asarray(ids)), id_sets(np.asarray(ref))
    assert got == want
    local = c["q_pos"] // BLK
    for key, st in got.items():
        if want[key]:                    # rows that see some key always hold their local block
            assert local[key[0], key[2]] in st
    return np.asarray(ref)


@pytest.mark.parametrize("name,init_blocks,local_blocks", [
    pytest.param("self_unpacked", 0, 1, marks=slow), pytest.param("suffix", 0, 1, marks=slow),
    ("packed_unaligned_tail_empty", 0, 1), ("self_unpacked", 1, 2)])
def test_select_blocks_sets_match_reference(name, init_blocks, local_blocks):
    kw, _ = CASES[name]
    topk = 5
    rng = np.random.default_rng(2)
    c = make_case(rng, **kw)
    hi = kw["g"]
    qi = rng.standard_normal((kw["bsz"], kw["t"], hi, 16)).astype(np.float32)
    ki = rng.standard_normal((kw["bsz"], kw["s"], 16)).astype(np.float32)
    ids = _select_gpu(jnp.asarray(qi), jnp.asarray(ki), block_size=BLK, topk=topk,
                      init_blocks=init_blocks, local_blocks=local_blocks, rows=16, **positions(c))
    ref = _check_selection(ids, c, qi, ki, topk, init_blocks, local_blocks)
    if init_blocks == 0 and local_blocks == 1:   # same order as the reference, too
        np.testing.assert_array_equal(np.asarray(ids), ref)


@slow
@pytest.mark.parametrize("s", [1, 127, 128, 129, 2047, 2048, 2049, 2304])
def test_length_cases_block128_top16(s):
    """MSA_SPEC length cases with B=128, K=16 (queries: the last <= 16 keys, 1 kv head)."""
    global BLK
    rng = np.random.default_rng(3)
    t = min(s, 16)
    c = make_case(rng, bsz=1, t=t, s=s, h=2, g=1, d=16)
    qi = rng.standard_normal((1, t, 1, 16)).astype(np.float32)
    ki = rng.standard_normal((1, s, 16)).astype(np.float32)
    old, BLK = BLK, 128
    try:
        ids = _select_gpu(jnp.asarray(qi), jnp.asarray(ki), block_size=128, topk=16, rows=16,
                          **positions(c))
        _check_selection(ids, c, qi, ki, 16)
        o, lse, grads = _run_attention(c, np.asarray(ids), jnp.float32)
        ro, rlse, rgrads = _reference(c, np.asarray(ids))
    finally:
        BLK = old
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=1e-5)
    for a, b in zip(grads, rgrads):
        _assert_grads_close(a, b, 0.9999, 1e-4)


@slow   # also run by default in tests/kernels/msa/test_msa_kernels_gpu_bf16.py
def test_short_context_equals_dense_causal_attention():
    """Contexts of at most K*B tokens select every block: MSA == dense causal attention."""
    from minimax_jax.ops.attention import attention as dense_attention
    rng = np.random.default_rng(4)
    c = make_case(rng, bsz=1, t=60, s=60, h=4, g=2, d=16)
    qi = rng.standard_normal((1, 60, 2, 16)).astype(np.float32)
    ki = rng.standard_normal((1, 60, 16)).astype(np.float32)
    pos = positions(c)
    ids = _select_gpu(jnp.asarray(qi), jnp.asarray(ki), block_size=BLK, topk=4, rows=16, **pos)
    o, _ = jax.jit(lambda q, k, v, ids: msa_attention_gpu(q, k, v, ids, block_size=BLK, interpret=True, **pos))(
        jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]), ids)
    ref = jax.jit(lambda q, k, v: dense_attention(q, k, v, q_positions=pos["q_positions"],
                                                  kv_positions=pos["kv_positions"]))(
        jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]))
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_op_dispatch_and_errors():
    rng = np.random.default_rng(5)
    c = make_case(rng, bsz=1, t=16, s=40, h=2, g=1, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 1, 3, BLK)
    args = (jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]), jnp.asarray(ids))
    with pytest.raises(ImplementationUnavailable):
        msa_ops.msa_attention(*args, block_size=BLK, implementation="cuda", **positions(c))
    with pytest.raises(AssertionError, match="power of two"):     # the kernel's own precondition
        msa_attention_gpu(jnp.zeros((1, 4, 2, 16)), jnp.zeros((1, 8, 2, 16)),
                          jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 2, 4, 2), jnp.int32),
                          q_positions=jnp.zeros((1, 4), jnp.int32),
                          kv_positions=jnp.zeros((1, 8), jnp.int32), block_size=24)
    clear_implementation_report()
    o, _ = msa_ops.msa_attention(*args, block_size=BLK, implementation="pallas_gpu_interpret", **positions(c))
    assert implementation_report()["msa_attention"] == "pallas_gpu_interpret"
    ro, _ = msa_ops.msa_attention(c["q"], c["k"], c["v"], ids, block_size=BLK,
                                  implementation="xla", **positions(c))
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)


def test_kernels_lower_for_cuda():
    """The Triton-lowered kernels (fwd, bwd, indexer) lower for CUDA on this CPU machine."""
    sd = jax.ShapeDtypeStruct
    b, t, h, g, d = 1, 512, 16, 2, 128
    args = (sd((b, t, h, d), jnp.bfloat16), sd((b, t, g, d), jnp.bfloat16),
            sd((b, t, g, d), jnp.bfloat16), sd((b, g, t, 4), jnp.int32), sd((b, t), jnp.int32))

    def f(q, k, v, ids, pos):
        loss = lambda q, k, v: msa_attention_gpu(q, k, v, ids, q_positions=pos, kv_positions=pos,
                                                 block_size=128)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def sel(qi, ki, pos):
        return msa_select_blocks_gpu(qi, ki, q_positions=pos, kv_positions=pos, block_size=128,
                                     topk=4)
    txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") >= 3 or txt.count("triton") >= 3
    txt = jax.jit(sel).trace(sd((b, t, g, 128), jnp.bfloat16), sd((b, t, 128), jnp.bfloat16),
                             sd((b, t), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in txt


def test_layout_contract_is_checked_eagerly():
    """Layouts the kernels cannot handle raise instead of silently giving wrong results."""
    rng = np.random.default_rng(6)
    c = make_case(rng, bsz=1, t=8, s=40, h=2, g=1, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 1, 2, BLK)
    args = (jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]), jnp.asarray(ids))
    bad_pos = c["kv_pos"].copy()
    bad_pos[0, 5] -= 1                                  # a repeat inside the segment
    with pytest.raises(ImplementationUnavailable, match="increase by 1"):
        msa_ops.msa_attention(*args, q_positions=c["q_pos"], kv_positions=bad_pos, block_size=BLK,
                              implementation="pallas_gpu_interpret")
    seg = np.zeros((1, 40), np.int32)
    seg[0, 10:20] = 1                                   # segment 0 stored in two runs
    with pytest.raises(ImplementationUnavailable, match="several runs"):
        msa_ops.msa_select_blocks(jnp.zeros((1, 8, 1, 16)), jnp.zeros((1, 40, 16)),
                                  q_positions=c["q_pos"], kv_positions=c["kv_pos"],
                                  q_segment_ids=seg[:, 32:], kv_segment_ids=seg, block_size=BLK,
                                  topk=2, implementation="pallas_gpu_interpret")


def _supports(op, impl, *args, **kw):
    """The ``supports`` verdict of one registered kernel implementation (None = it serves the call)."""
    return get_op(op).implementations[impl].supports(*args, **kw)


def test_supports_hook():
    rng = np.random.default_rng(7)
    c = make_case(rng, bsz=1, t=8, s=40, h=2, g=1, d=16)
    args = (jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]),
            jnp.zeros((1, 1, 8, 2), jnp.int32))
    pos = positions(c)
    assert _supports("msa_attention", "pallas_gpu", *args, block_size=16, **pos) is None
    assert "power of two" in _supports("msa_attention", "pallas_gpu", *args, block_size=24, **pos)
    assert "multiple of 128" in _supports("msa_attention", "pallas_tpu", *args, block_size=16, **pos)
    assert "pallas_gpu" not in get_op("msa_index_scores").implementations     # no kernel: xla only
    bad = dict(pos, kv_positions=pos["kv_positions"].at[0, 3].set(7))
    assert "increase by 1" in _supports("msa_attention", "pallas_gpu", *args, block_size=16, **bad)
    # Block selection takes (qi, ki) only: the hook must not index a third argument.
    assert _supports("msa_select_blocks", "pallas_gpu", args[0], args[1], block_size=16, topk=2, **pos) is None
    assert "powers of two" in _supports("msa_select_blocks", "pallas_gpu", args[0][..., :12], args[1][..., :12],
                                        block_size=16, topk=2, **pos)


@slow   # also run by default in tests/kernels/msa/test_msa_kernels_gpu_layouts.py
def test_duplicate_and_out_of_range_ids_count_once():
    """Duplicated ids count once and out-of-range / negative ids select nothing (op contract)."""
    rng = np.random.default_rng(8)
    c = make_case(rng, bsz=1, t=12, s=64, h=2, g=1, d=16)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 1, 3, BLK)
    messy = np.concatenate([ids, ids[..., :1], np.full(ids.shape[:3] + (1,), 99, np.int32),
                            np.full(ids.shape[:3] + (1,), -7, np.int32)], axis=-1)
    pos = positions(c)
    args = (jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]))
    attn = jax.jit(lambda q, k, v, ids: msa_attention_gpu(q, k, v, ids, block_size=BLK, interpret=True, **pos))
    o1, l1 = attn(*args, jnp.asarray(messy))
    o2, l2 = attn(*args, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-6)


@slow   # also run by default in tests/kernels/msa/test_msa_kernels_gpu_layouts.py
def test_decode_like_layout_queries_not_at_the_end():
    """A gathered cache (kv_pos = arange(S), unwritten future slots, padding query rows in another
    segment): queries sit at arbitrary positions, not at the end of the keys."""
    rng = np.random.default_rng(9)
    s, t = 96, 3
    c = make_case(rng, bsz=2, t=t, s=s, h=4, g=2, d=16)
    c["q_pos"] = np.array([[37, 80, 0], [5, 64, 95]], np.int32)
    c["q_seg"] = np.array([[0, 0, 1], [0, 0, 0]], np.int32)       # row (0, 2) is padding
    qi = rng.standard_normal((2, t, 2, 16)).astype(np.float32)
    ki = rng.standard_normal((2, s, 16)).astype(np.float32)
    pos = positions(c)
    ids = _select_gpu(jnp.asarray(qi), jnp.asarray(ki), block_size=BLK, topk=3, rows=16, **pos)
    _check_selection(ids, c, qi, ki, 3)
    o, lse, grads = _run_attention(c, np.asarray(ids), jnp.float32)
    ro, rlse, rgrads = _reference(c, np.asarray(ids))
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(rlse)))
    for a, b in zip(grads, rgrads):
        _assert_grads_close(a, b, 0.9999, 1e-4)


def test_selection_under_grad():
    """Training differentiates through the layer: selection (integer ids, no gradient) must trace
    under jax.grad on every Pallas backend (a pallas_call has no JVP rule)."""
    rng = np.random.default_rng(10)
    qi = jnp.asarray(rng.standard_normal((1, 64, 1, 16)), jnp.float32)
    ki = jnp.asarray(rng.standard_normal((1, 64, 16)), jnp.float32)
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    for impl in ("pallas_gpu_interpret", "pallas_tpu_interpret"):
        def f(qi, ki):
            ids = msa_ops.msa_select_blocks(qi, ki, q_positions=pos, kv_positions=pos, block_size=16, topk=2,
                                            implementation=impl)
            return jnp.sum(qi * ids[..., 0].transpose(0, 2, 1)[..., None]) + jnp.sum(ki ** 2)
        gq, gk = jax.jit(jax.grad(f, argnums=(0, 1)))(qi, ki)     # traced under grad, then compiled once
        ids = np.asarray(msa_ops.msa_select_blocks(qi, ki, q_positions=pos, kv_positions=pos, block_size=16,
                                                   topk=2, implementation="xla"))
        np.testing.assert_array_equal(gq, np.broadcast_to(ids[..., 0].transpose(0, 2, 1)[..., None], qi.shape))
        np.testing.assert_allclose(gk, 2 * np.asarray(ki), rtol=1e-6)
