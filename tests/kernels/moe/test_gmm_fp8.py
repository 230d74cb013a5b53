"""FP8 weights in the grouped matmul (pallas_kernels/moe/gpu_gmm_fp8.py) in interpret mode on CPU.

Oracle: the same kernel on the weights dequantised first (bit for bit: the kernel dequantises each tile exactly as
``Fp8Weight.astype`` does) and ``jax.lax.ragged_dot`` in float32 on those weights (bf16 output tolerance); rows
past the group sum are 0; the lhs gradient equals the bf16 transposed kernel's, the FP8 weights get zero
cotangents. Published 128 x 128 blocks, partial edge blocks, finer blocks, decode-like one-row groups; the
refusal of blocks finer than a tile; lowering for CUDA at M2 shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import gpu_gmm, gpu_gmm_fp8
from pallas_kernels.common import needs_byte_pairs
from pallas_kernels.moe.gpu_gmm import TileConfig
from tests.kernels.moe.test_gmm_pallas import HI, _close, _sizes


def _fp8_case(seed, m, k, n, g, n_empty, block, dtype=jnp.bfloat16):
    """Random e4m3 weights with random positive block scales, their dequantised copy (as Fp8Weight.astype:
    float32(w) * scale rounded to ``dtype``) and bf16 rows; sizes with empty groups and rows past the sum."""
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, m, g, n_empty)
    q = jnp.asarray(rng.normal(size=(g, k, n)) * 4.0, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, (g, -(-k // block[0]), -(-n // block[1]))), jnp.float32)
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=1)[:, :k], block[1], axis=2)[:, :, :n]
    deq = (q.astype(jnp.float32) * s).astype(dtype)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    return lhs, q, scale, deq, jnp.asarray(sizes, jnp.int32), sizes


@pytest.mark.parametrize("cfg", [None, gpu_gmm_fp8.DEFAULT_FP8_CONFIG, gpu_gmm_fp8.DECODE_FP8_CONFIG, TileConfig(32, 32, 64, 4, 2)])
@pytest.mark.parametrize("m,k,n,g,n_empty,block", [
    (300, 256, 384, 5, 1, (128, 128)),        # the published block: several scale blocks per expert
    (190, 200, 136, 4, 1, (128, 128)),        # partial edge blocks, K / N tails masked
    (96, 128, 128, 9, 3, (64, 128)),          # a finer row block; mostly 1-row groups (decode-like)
])
def test_gmm_fp8_equals_dequantised_first(cfg, m, k, n, g, n_empty, block):
    """In-kernel dequantisation is bit for bit the kernel on weights dequantised first (same tiles), matches
    ragged_dot on those weights, stores 0 past the group sum; d lhs equals the bf16 kernel's, the FP8 weights
    get zero cotangents."""
    if cfg is not None and gpu_gmm_fp8.fp8_unsupported((g, k, n), block, cfg) is not None:
        pytest.skip(f"{cfg.label()} does not fit block {block}")
    lhs, q, scale, deq, gs, sizes = _fp8_case(m + k + n, m, k, n, g, n_empty, block)
    ref_cfg = cfg or gpu_gmm_fp8.fp8_config(m, g, block)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(m, n)), jnp.bfloat16)

    @jax.jit
    def run(lhs, q, scale, cot):
        y, vjp = jax.vjp(lambda a, w, s: gpu_gmm_fp8.gmm_fp8(a, w, s, gs, scale_block=block, config=cfg, interpret=True),
                         lhs, q, scale)
        return (y, *vjp(cot))
    y, dlhs, dq, dscale = run(lhs, q, scale, cot)
    first = gpu_gmm.gmm_forward(lhs, deq, gs, config=ref_cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(first, np.float32))
    total = int(sizes.sum())
    assert np.all(np.asarray(y, np.float32)[total:] == 0)
    ref = jax.lax.ragged_dot(lhs.astype(jnp.float32), deq.astype(jnp.float32), gs, precision=HI)
    _close(np.asarray(y, np.float32)[:total], np.asarray(ref)[:total], jnp.bfloat16, "fp8 forward")
    dref = gpu_gmm.gmm_forward(cot, deq, gs, transpose_rhs=True, config=gpu_gmm.DEFAULT_DLHS_CONFIG, interpret=True)
    np.testing.assert_array_equal(np.asarray(dlhs, np.float32), np.asarray(dref, np.float32))
    assert not np.any(np.asarray(dq, np.float32)) and not np.any(np.asarray(dscale))


@pytest.mark.parametrize("cfg", [gpu_gmm_fp8.DEFAULT_FP8_CONFIG, gpu_gmm_fp8.DECODE_FP8_CONFIG,
                                 TileConfig(128, 64, 128, 4, 2, fold=64)])
@pytest.mark.parametrize("m,k,n,g,n_empty", [(300, 256, 384, 5, 1), (190, 200, 136, 4, 1)])
def test_gmm_fp8_byte_pairs_equal_bytes(cfg, m, k, n, g, n_empty):
    """The FP8 rhs read as uint16 byte pairs (what 1-byte weights of >= 2**31 elements take: Pallas' Triton
    offsets are int32 below 2**32 bytes) gives the values of the byte-wise kernel: even / odd columns as two dots
    stored with stride 2, N tails masked per half, folded tails, rows past the group sum 0."""
    block = (128, 128)
    lhs, q, scale, _, gs, sizes = _fp8_case(m * n, m, k, n, g, n_empty, block)
    run = lambda pairs: gpu_gmm.gmm_forward(lhs, q, gs, config=cfg, interpret=True, rhs_scale=scale,
                                            scale_block=block, fp8_pairs=pairs)
    y1, y2 = (np.asarray(run(p), np.float32) for p in (False, True))
    np.testing.assert_array_equal(y2, y1)
    assert np.all(y2[int(sizes.sum()):] == 0) and np.any(y2)


def test_byte_pairs_only_in_the_int32_offset_gap():
    """Byte pairs exactly for 1-byte arrays of [2**31, 2**32] elements: M2's FP8 gate / up weights (256 x 3072 x
    3072) yes, its down weights (256 x 1536 x 3072), M3's (128 x 6144 x 6144: 64-bit offsets) and bf16 no."""
    sd = jax.ShapeDtypeStruct
    assert needs_byte_pairs(sd((256, 3072, 3072), jnp.float8_e4m3fn))
    assert not needs_byte_pairs(sd((256, 1536, 3072), jnp.float8_e4m3fn))
    assert not needs_byte_pairs(sd((128, 6144, 6144), jnp.float8_e4m3fn))
    assert not needs_byte_pairs(sd((256, 3072, 3072), jnp.bfloat16))


def test_gmm_fp8_refuses_blocks_that_split_tiles():
    """Scale blocks finer than a tile: a one-line ValueError naming the block and the tiles (the ops layer then
    dequantises first and records why)."""
    assert gpu_gmm_fp8.fp8_unsupported((4, 256, 256), (128, 128)) is None
    why = gpu_gmm_fp8.fp8_unsupported((4, 256, 256), (128, 8))
    assert why is not None and "(128, 8)" in why and "16 x 16" in why
    assert gpu_gmm_fp8.fp8_config(64, 4, (64, 32)) == TileConfig(16, 64, 32, 4, 4)
    lhs, q, scale, _, gs, _ = _fp8_case(0, 64, 64, 64, 4, 1, (64, 32))
    with pytest.raises(ValueError, match=r"gmm_fp8: scale block \(64, 32\) is not a multiple of the 64 x 128"):
        gpu_gmm_fp8.gmm_fp8(lhs, q, scale, gs, scale_block=(64, 32), config=gpu_gmm_fp8.DEFAULT_FP8_CONFIG, interpret=True)


def test_gmm_fp8_lowers_for_cuda_at_m2_shapes():
    """The FP8 forward (prefill and decode tiles) and its lhs gradient lower to Triton custom calls for CUDA at
    M2's first expert projection (256 experts, 3072 x 3072 in 128 x 128 blocks)."""
    sd = jax.ShapeDtypeStruct
    for m in (256, 65536):
        def f(a, w, s, gs, c):
            y, vjp = jax.vjp(lambda a: gpu_gmm_fp8.gmm_fp8(a, w, s, gs), a)
            return y, vjp(c)
        txt = jax.jit(f).trace(sd((m, 3072), jnp.bfloat16), sd((256, 3072, 3072), jnp.float8_e4m3fn),
                               sd((256, 24, 24), jnp.float32), sd((256,), jnp.int32),
                               sd((m, 3072), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") == 2, m
        assert "gmm_fp8_gpu" in txt
