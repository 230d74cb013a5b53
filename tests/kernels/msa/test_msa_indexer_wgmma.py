"""The Hopper (Mosaic GPU) MSA indexer (pallas_kernels/msa/gpu_indexer_wgmma.py).

In the Mosaic GPU interpreter (jax >= 0.11; skipped, saying so, on older jax): block-id SETS against the
XLA reference (``minimax_jax.ops.msa``, implementation "xla") on the same bf16 inputs, every row, with the
local block present; a set may differ only on a near-tie (every selected block's reference score >= the
(K-1)-th best - 1e-4, the MSA repo's criterion with a tolerance for fp32 summation order). Layouts: causal
self-attention (long mask-free prefix), queries as an unaligned suffix of the keys, packed documents of
unaligned lengths with empty slots (masked tiles, blocks split over two key tiles), sink and extra local
blocks, 1 / 4 / 8 index heads, blocks of 64 and 128, Di 64 and 128. The FP8 (e4m3) path: recall of the bf16
selection. On any jax: the CUDA lowering at M3 shapes (1M tokens) and ``wgmma_indexer_supported``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from pallas_kernels.common import mosaic_interpret_params, mosaic_interpreter_available
from pallas_kernels.msa.gpu_indexer_wgmma import (block_topk_wgmma, msa_select_blocks_wgmma, quantize_index_fp8,
                                                  wgmma_indexer_supported)
from tests.kernels.msa.test_msa_kernels_oracle import make_case, positions

needs_interpreter = pytest.mark.skipif(
    not mosaic_interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")


def _inputs(rng, c, hi, di):
    bsz, t = c["q_pos"].shape
    s = c["kv_pos"].shape[1]
    qi = jnp.asarray(rng.standard_normal((bsz, t, hi, di)), jnp.bfloat16)
    ki = jnp.asarray(rng.standard_normal((bsz, s, di)), jnp.bfloat16)
    return qi, ki


def _check(c, qi, ki, blk, topk, init_blocks=0, local_blocks=1, **kw):
    """Kernel ids vs the reference's on the same (bf16-rounded) values; returns (ids, ref ids)."""
    pos = positions(c)
    sel = dict(block_size=blk, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    ids = np.asarray(jax.jit(lambda qi, ki: msa_select_blocks_wgmma(qi, ki, interpret=True, **sel, **pos, **kw))(
        qi, ki))
    f32 = lambda x: x.astype(jnp.float32)
    ref = np.asarray(msa_ops.msa_select_blocks(f32(qi), f32(ki), implementation="xla", **sel, **pos))
    scores = np.asarray(msa_ops.msa_index_scores(f32(qi), f32(ki), block_size=blk, implementation="xla", **pos))
    assert ids.shape == ref.shape and ids.dtype == np.int32
    local = c["q_pos"] // blk
    n_diff = 0
    for idx in np.ndindex(ids.shape[:3]):
        got = [int(x) for x in ids[idx] if x >= 0]
        want = [int(x) for x in ref[idx] if x >= 0]
        assert len(got) == len(set(got)), (idx, ids[idx])
        assert len(got) == len(want), (idx, ids[idx], ref[idx])
        if want:
            assert local[idx[0], idx[2]] in got, (idx, ids[idx])
        if set(got) != set(want):        # only a near-tie may differ
            n_diff += 1
            b, r, i = idx
            sc = scores[b, r, i, : local[b, i] - local_blocks + 1]
            n_rank = topk - init_blocks - local_blocks
            kth = np.sort(sc[init_blocks:])[::-1][min(n_rank, len(sc) - init_blocks) - 1]
            for x in set(got) - set(want):
                assert sc[x] >= kth - 1e-4, (idx, x, sc[x], kth)
    assert n_diff <= max(2, ids.size // ids.shape[-1] // 100), n_diff      # near-ties are rare on random data
    return ids, ref


@needs_interpreter
@pytest.mark.parametrize("blk,hi,di", [(64, 4, 128), (128, 8, 64)])
def test_causal_self_attention(blk, hi, di):
    """Unpacked prefill: every rankable block of a row tile is a whole mask-free key tile."""
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=1, t=12 * blk, s=12 * blk, h=hi, g=hi, d=16)
    qi, ki = _inputs(rng, c, hi, di)
    ids, ref = _check(c, qi, ki, blk, topk=5)
    assert (ids == ref).mean() > 0.99                  # the reference order too, near-ties aside


@needs_interpreter
def test_queries_as_unaligned_suffix_and_two_batch_rows():
    """300 queries after 517 earlier keys (row tiles straddle blocks), two batch rows, one index head."""
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=2, t=300, s=817, h=1, g=1, d=16)
    qi, ki = _inputs(rng, c, 1, 64)
    _check(c, qi, ki, 64, topk=6)


@needs_interpreter
def test_packed_unaligned_documents_with_empty_slots():
    """Documents of 200, 333 and 170 keys then 65 empty slots: blocks split over two key tiles (masked
    tiles with a carried block tail), row tiles spanning documents, padded rows."""
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=1, t=768, s=768, h=4, g=4, d=16, segments=[[200, 333, 170]])
    qi, ki = _inputs(rng, c, 4, 64)
    ids, _ = _check(c, qi, ki, 64, topk=4)
    assert (ids[0, :, 703:] == -1).all()               # empty slots select nothing


@needs_interpreter
def test_sink_and_extra_local_blocks():
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=640, s=640, h=4, g=4, d=16, segments=[[100, 540]])
    qi, ki = _inputs(rng, c, 4, 64)
    _check(c, qi, ki, 64, topk=6, init_blocks=1, local_blocks=2)


@needs_interpreter
def test_fp8_index_path_recall():
    """e4m3 index queries / keys with per-vector scales: most of the bf16 selection is kept."""
    rng = np.random.default_rng(4)
    c = make_case(rng, bsz=1, t=1024, s=1024, h=4, g=4, d=16)
    qi, ki = _inputs(rng, c, 4, 128)
    pos = positions(c)
    run = lambda **kw: np.asarray(jax.jit(lambda qi, ki: msa_select_blocks_wgmma(
        qi, ki, block_size=64, topk=6, interpret=True, **pos, **kw))(qi, ki))
    bf, f8 = run(), run(index_dtype="float8_e4m3fn")
    hit = tot = 0
    for idx in np.ndindex(bf.shape[:3]):
        want = set(int(x) for x in bf[idx] if x >= 0)
        hit += len(want & set(int(x) for x in f8[idx] if x >= 0))
        tot += len(want)
    assert tot and 0.9 < hit / tot < 1.0 + 1e-9, hit / tot
    # the kept scores are dequantised: within e4m3 rounding of the bf16 ones
    q8, qs, k8, ks = quantize_index_fp8(qi, ki)
    tv, ti, _ = block_topk_wgmma(q8, k8, qi_scale=qs, ki_scale=ks, block_size=64, topk=6, interpret=True, **pos)
    ref = msa_ops.msa_index_scores(qi.astype(jnp.float32), ki.astype(jnp.float32), block_size=64,
                                   implementation="xla", **pos)          # [B, Hi, T, NB]
    tv, ti = np.asarray(tv), np.asarray(ti)
    ok = ti >= 0
    want = np.take_along_axis(np.swapaxes(np.asarray(ref), 1, 2), np.maximum(ti, 0), axis=-1)
    np.testing.assert_allclose(tv[ok], want[ok], atol=0.1 * np.abs(want[ok]).max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_lowers_for_cuda_at_1m_tokens(dtype):
    """M3 index shapes (4 heads, Di 128, block 128, top-16) at 1M tokens lower for CUDA on a CPU machine."""
    sd = jax.ShapeDtypeStruct
    t = 1 << 20
    f = lambda qi, ki, pos: msa_select_blocks_wgmma(qi, ki, q_positions=pos, kv_positions=pos, block_size=128,
                                                    topk=16, index_dtype=dtype)
    txt = jax.jit(f).trace(sd((1, t, 4, 128), jnp.bfloat16), sd((1, t, 128), jnp.bfloat16),
                           sd((1, t), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("mosaic_gpu") >= 1


def test_supported_shapes():
    ok = lambda hi, di, dt, blk: wgmma_indexer_supported((1, 8, hi, di), (1, 8, di), dt, blk)
    assert ok(4, 128, jnp.bfloat16, 128) is None and ok(8, 128, jnp.float16, 64) is None      # M3, M2
    assert ok(4, 128, jnp.float8_e4m3fn, 256) is None
    assert "dtype" in ok(4, 128, jnp.float32, 128)
    assert "index heads" in ok(3, 128, jnp.bfloat16, 128)
    assert "index dim" in ok(4, 96, jnp.bfloat16, 128)
    assert "block size" in ok(4, 128, jnp.bfloat16, 32)
    assert "do not fit shared memory" in ok(4, 256, jnp.bfloat16, 256)        # q rows + two key tiles > 227 KiB
    if not mosaic_interpreter_available():
        x = jnp.zeros((1, 64, 4, 64), jnp.bfloat16)
        pos = jnp.arange(64, dtype=jnp.int32)[None]
        with pytest.raises(NotImplementedError, match="jax >= 0.11"):
            msa_select_blocks_wgmma(x, x[:, :, 0], q_positions=pos, kv_positions=pos, block_size=64, topk=2,
                                    interpret=True)


@needs_interpreter
def test_interpreter_refuses_a_pool_too_small_for_three_warpgroups(monkeypatch):
    """Three warpgroups wait on each other as concurrent XLA CPU executions: a pool of 2 (a 2-core
    machine's default) could deadlock, so the call refuses and names the fix."""
    monkeypatch.delenv("PJRT_NPROC", raising=False)          # read by XLA before NPROC
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(RuntimeError, match="NPROC=4"):
        mosaic_interpret_params("block_topk_wgmma")
    monkeypatch.setenv("NPROC", "4")
    assert mosaic_interpret_params("block_topk_wgmma") is not None
