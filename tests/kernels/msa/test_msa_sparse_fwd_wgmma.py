"""The Hopper (Mosaic GPU) KV-outer MSA forward (pallas_kernels/msa/gpu_sparse_fwd_wgmma.py).

In the Mosaic GPU interpreter (jax >= 0.11; the tests skip and say so on older jax), o and lse against
the fp32 XLA reference (``minimax_jax.ops.msa``, implementation "xla", on the same bf16-rounded inputs),
every element: 16 heads per group with 64- and 128-key blocks (aligned windows), 6 and 3 heads per
group (padded 8-row head slots), packed documents of
unaligned lengths (wide windows) with empty slots, queries as a suffix of the keys, tokens with no
selection (-1 ids) and duplicate ids; small ``chunk`` splits runs over programs. On any jax: the CUDA
lowering at M3 shapes (128K tokens) and the ``wgmma_supported`` predicate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from pallas_kernels.common import mosaic_interpreter_available as interpreter_available
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import head_slot, sparse_fwd_wgmma, wgmma_supported
from tests.kernels.msa.test_msa_kernels_oracle import make_case, positions, random_ids

needs_interpreter = pytest.mark.skipif(
    not interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")


def _run_and_check(c, ids, blk, chunk, **kw):
    return run_and_check(c, ids, blk, sparse_fwd_wgmma, chunk=chunk, **kw)


def run_and_check(c, ids, blk, forward, **kw):
    """``forward`` (a Hopper forward kernel, interpreted) on bf16 inputs of case ``c`` against the fp32 XLA
    reference, every element: returns (finite-lse mask, o, lse)."""
    q, k, v = (jnp.asarray(c[n], jnp.bfloat16) for n in ("q", "k", "v"))
    pos = positions(c)
    o, lse = jax.jit(lambda q, k, v, ids: forward(
        q, k, v, ids, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"], pos["kv_segment_ids"],
        block_size=blk, interpret=True, **kw))(q, k, v, jnp.asarray(ids))
    assert o.shape == q.shape[:3] + (v.shape[-1],) and o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    f32 = lambda x: x.astype(jnp.float32)
    ro, rlse = msa_ops.msa_attention(f32(q), f32(k), f32(v), jnp.asarray(ids), block_size=blk,
                                     implementation="xla", **pos)
    o, lse, ro, rlse = (np.asarray(x, np.float64) for x in (o, lse, ro, rlse))
    # bf16 P and bf16 partials / output: a few bf16 ulps of |o| <= max |v|; lse is f32 throughout
    np.testing.assert_allclose(o, ro, atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=1e-4, rtol=1e-5)
    assert np.all(o[~np.broadcast_to(fin[..., None], o.shape)] == 0.0)
    return fin, o, lse


@needs_interpreter
@pytest.mark.parametrize("blk,chunk", [(64, 64), (128, 512)])
def test_m3_like_groups_empty_and_duplicate_ids(blk, chunk):
    """16 heads per group (M3), 8-row aligned windows; some tokens select nothing, some repeat an id.
    chunk 512: a slice's work-list tables reach SMEM in two TMA copies each, the last slice padded."""
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=1, t=192, s=192, h=32, g=2, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, blk)
    ids[0, :, 150:153] = -1                     # no selection: lse -inf, o = 0
    ids[0, 1, 180, :] = ids[0, 1, 180, 0]       # duplicates count once
    ids[0, 0, 130, 1:] = ids[0, 0, 130, 0]
    fin, _, _ = _run_and_check(c, ids, blk, chunk=chunk)
    assert not fin[0, 151].any() and fin[0, 180].all()


@needs_interpreter
def test_packed_unaligned_documents():
    """Documents of 37, 70 and 43 keys and 10 empty slots (segment -1): the windows of the second and
    third start off 8-row boundaries (the wide-window kernel, which also serves the aligned windows of
    the first); 8 heads per group (8 selections per row tile)."""
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=1, t=160, s=160, h=16, g=2, d=128, segments=[[37, 70, 43]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, 64)
    fin, _, _ = _run_and_check(c, ids, 64, chunk=32)
    assert not fin[0, 150:].any()               # empty slots see nothing


@needs_interpreter
@pytest.mark.parametrize("h,g", [(32, 2), (12, 2)])
def test_query_passes_read_q_at_an_offset(h, g):
    """200 queries in passes of 64 and of 96 (the last pass clamped to end at T; each pass reads its q rows from
    the whole q at its offset), 16 heads per group and 6 (M2-like: q padded to 8-row head slots once): bitwise the
    outputs of one pass."""
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=1, t=200, s=200, h=h, g=g, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 4, 64)
    _, o, lse = _run_and_check(c, ids, 64, chunk=64)
    for kw in (dict(query_chunk=64), dict(query_chunk=96)):
        _, o2, lse2 = _run_and_check(c, ids, 64, chunk=64, **kw)
        np.testing.assert_array_equal(o2, o)
        np.testing.assert_array_equal(lse2, lse)


@needs_interpreter
def test_queries_as_suffix_of_keys():
    """72 queries after 228 earlier keys, 32 heads per group (2 selections per tile), D = Dv = 64."""
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=72, s=300, h=64, g=2, d=64)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, 128)
    _run_and_check(c, ids, 128, chunk=32)


@needs_interpreter
@pytest.mark.parametrize("h,g", [(12, 2), (6, 2)])
def test_padded_head_slots_m2_like(h, g):
    """6 heads per group (M2: slots of 8 rows, 8 selections per tile) and 3 (slots of 8): the spare
    slot rows compute and are dropped; causal blocks of 64 with a packed second document."""
    rng = np.random.default_rng(4)
    c = make_case(rng, bsz=1, t=200, s=200, h=h, g=g, d=64, segments=[[128, 72]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 3, 64)
    _run_and_check(c, ids, 64, chunk=32)


@pytest.mark.parametrize("blk,chunk", [(64, 128), (128, 32), (128, 512)])
def test_lowers_for_cuda_at_m3_shapes(blk, chunk):
    """M3 attention shapes at 128K tokens (64 heads, 4 kv groups, D 128, top-16 blocks, query chunks):
    both kernel variants (aligned / wide windows) lower for CUDA on a CPU machine, at the smallest slice
    (32 entries: one 128-byte table copy) and at one of two copies per table (512)."""
    sd = jax.ShapeDtypeStruct
    b, t, h, g, d, topk = 1, 131072, 64, 4, 128, 16

    def f(q, k, v, ids, pos):
        return sparse_fwd_wgmma(q, k, v, ids, pos, pos, None, None, block_size=blk, chunk=chunk)
    txt = jax.jit(f).trace(sd((b, t, h, d), jnp.bfloat16), sd((b, t, g, d), jnp.bfloat16),
                           sd((b, t, g, d), jnp.bfloat16), sd((b, g, t, topk), jnp.int32),
                           sd((b, t), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("mosaic_gpu") >= 2


def test_supported_shapes():
    assert wgmma_supported((1, 8, 64, 128), (1, 8, 4, 128), 128, jnp.bfloat16, 128) is None    # M3
    assert wgmma_supported((1, 8, 64, 64), (1, 8, 8, 64), 64, jnp.float16, 64) is None
    assert wgmma_supported((1, 8, 48, 128), (1, 8, 8, 128), 128, jnp.bfloat16, 128) is None    # M2: slots of 8
    assert "heads per group" in wgmma_supported((1, 8, 130, 64), (1, 8, 2, 64), 64, jnp.bfloat16, 128)
    assert [head_slot(n) for n in (1, 3, 6, 8, 12, 16, 17, 64)] == [8, 8, 8, 8, 16, 16, 32, 64]
    assert "dtype" in wgmma_supported((1, 8, 64, 128), (1, 8, 4, 128), 128, jnp.float32, 128)
    assert "head dims" in wgmma_supported((1, 8, 64, 96), (1, 8, 4, 96), 96, jnp.bfloat16, 128)
    assert "head dims" in wgmma_supported((1, 8, 64, 128), (1, 8, 4, 128), 64, jnp.bfloat16, 128)
    assert "block size" in wgmma_supported((1, 8, 64, 128), (1, 8, 4, 128), 128, jnp.bfloat16, 32)
    if not interpreter_available():
        x = jnp.zeros((1, 64, 16, 128), jnp.bfloat16)
        kv = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
        pos = jnp.arange(64, dtype=jnp.int32)[None]
        with pytest.raises(NotImplementedError, match="jax >= 0.11"):
            sparse_fwd_wgmma(x, kv, kv, jnp.zeros((1, 1, 64, 1), jnp.int32), pos, pos, None, None,
                             block_size=64, interpret=True)
