"""Weight gradient of the grouped matmul (tgmm) on Hopper: a warp-specialized, persistent Pallas Mosaic GPU kernel.

Math: ``out[g] = lhs[rows of g]^T @ dout[rows of g]`` (the drhs of MegaBlocks' grouped GEMM, Gale et al.
2022, arXiv 2211.15841; same contract as ``gpu_gmm.tgmm``), fp32 accumulation, rows sorted by group.

Why a second tgmm: at ~256 rows per expert (M2 / M3, 8K tokens per step) each output tile of the Triton
tgmm (``gpu_gmm._tgmm_kernel``) is a loop of only 8 short steps, so every tile pays its pipeline fill and
its epilogue, and its one-CTA-per-SM 128 x 256 tiles (a quarter less L2 traffic per FLOP) were slower still
(it reaches well below the forward kernels' rate: see BENCHMARKS.md (MoE)). This kernel keeps loads
streaming across tiles instead:

- one CTA per SM (``plgpu.kernel`` grid = SM count) walks the output tiles ``(group, K tile, N tile)``
  (N tile fastest, group outermost: a group's rows stay in L2) with ``plgpu.nd_loop``;
- three warpgroups: a memory warpgroup issues TMA loads of ``[block_rows, block_k]`` lhs and
  ``[block_rows, block_n]`` dout blocks into a ring of ``stages`` SMEM slots, one running slot counter
  across all tiles of the CTA (the next tile's loads are in flight during this tile's epilogue); two
  compute warpgroups each own half of the tile's columns: ``wgmma`` of the transposed lhs block
  (``[block_k, block_rows]`` from SMEM) with its half of the dout block into a ``[block_k, block_n / 2]``
  fp32 accumulator, releasing each slot one step later (``wgmma_wait(1)``), then convert, write SMEM
  and TMA-store the tile;
- ragged rows: TMA row offsets into 8-row tiled SMEM must be multiples of 8, so a group's row blocks
  start at ``8 * floor(start / 8)``; the compute warpgroup zeroes the dout rows outside the group in the
  first and last block of each tile (in SMEM, its own column half, then ``commit_smem``) before the
  ``wgmma``. Rows past M read as zeros (TMA out-of-bounds fill; M is padded to a multiple of 8). lhs rows
  outside the group are not zeroed (both warpgroups read the whole lhs block): they meet zero dout rows,
  so a non-finite value in another group's lhs rows or in rows past the sum leaks into this group's
  gradient as NaN (0 * inf), which the Triton tgmm does not do. An empty group stores exact zeros.

Checked against an fp32 oracle in the Mosaic GPU interpreter (tests/kernels/moe/test_tgmm_ws.py, jax >= 0.11) and
against the Triton tgmm on a GPU by ``bench/tgmm_ws_probe.py``. ``gpu_gmm.gmm`` runs it when passed a ``WsTgmmConfig`` as ``tgmm_config``; the ops layer
(``minimax_jax.ops.moe.grouped_matmul``, ``pallas_gpu``) passes ``ws_tgmm_config``'s on Hopper wherever it fits.

Requirements (ValueError / TypeError otherwise, never a silent fallback): bf16 / f16 operands (the
Hopper ``wgmma`` of fp32 is TF32, not the IEEE fp32 the fp32 path promises), K % block_k == 0 and
N % block_n == 0 (M2: K, N in {1536, 3072}; M3: {3072, 6144}). Any M (padded to a multiple of 8).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import match_vma, mosaic_interpret_params, mosaic_smem_transforms, typed_out_struct
from pallas_kernels.moe.groups import group_bounds
from pallas_kernels.moe.ws_ring import (COMPUTE_REGISTERS, MEMORY_REGISTERS, check_config, drain_steps, fill_steps,
                                        mma_steps, over_tiles)

__all__ = ["WsTgmmConfig", "WS_TGMM_CANDIDATES", "tgmm_ws", "ws_tgmm_config"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class WsTgmmConfig:
    """Tile shape of ``tgmm_ws``: output tile ``[block_k, block_n]`` (two compute warpgroups of
    ``block_n / 2`` columns each), ``block_rows`` group rows per pipeline step, ``stages`` SMEM slots.

    block_rows: 64 or 128 (the ``wgmma`` contraction; the row mask of a [rows, block_n / 2] block in
    registers needs a multiple of 64 rows: with 16 or 32, Mosaic GPU's layout inference found no layout); block_k: 64 or 128 (rows of the
    fp32 accumulator); block_n: 128 or 256 (two warpgroups of 64 or 128 columns: at most 128 fp32
    accumulator registers per thread). num_sms: CTAs
    (default: the device's SM count). Raises ValueError for other values or a ring plus epilogue
    buffers over 227 KiB of shared memory.
    """
    block_rows: int = 64
    block_k: int = 128
    block_n: int = 256
    stages: int = 3
    num_sms: int | None = None

    def __post_init__(self):
        check_config(self, {"block_rows": (64, 128), "block_k": (64, 128), "block_n": (128, 256)}, self.smem_bytes(2))

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of the ring (lhs + dout blocks per stage) plus the two epilogue tiles."""
        ring = self.stages * self.block_rows * (self.block_k + self.block_n) * itemsize
        return ring + self.block_k * self.block_n * itemsize

    def label(self) -> str:
        """Short name, e.g. ``ws64r128x256s3``."""
        return f"ws{self.block_rows}r{self.block_k}x{self.block_n}s{self.stages}"


#: Candidates for a sweep (bench/tgmm_ws_probe.py), none measured yet (ring + epilogue <= 208 KiB in bf16):
#: 128 x 256 output tiles with 64-row steps and 2-3 stages, 64 x 256 tiles with 4 stages of 64 rows or 2
#: of 128, and 128 x 128 tiles with 4 stages.
WS_TGMM_CANDIDATES = (
    WsTgmmConfig(64, 128, 256, 3),
    WsTgmmConfig(64, 128, 256, 2),
    WsTgmmConfig(64, 64, 256, 4),
    WsTgmmConfig(128, 64, 256, 2),
    WsTgmmConfig(64, 128, 128, 4),
)


def ws_tgmm_config(k: int, n: int, dtype, num_sms: int | None = None) -> WsTgmmConfig | str:
    """The ``WsTgmmConfig`` for a weight gradient ``[K, N]`` per group in ``dtype``: output tiles of 128 x 256
    (the default), cut to 64 rows / 128 columns where K / N need it; or why the kernel cannot take it (a
    short sentence: fp32 operands, K or N not a multiple of 64 / 128). ``num_sms`` passes through."""
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bf16 / f16"
    bk = next((b for b in (128, 64) if k % b == 0), None)
    bn = next((b for b in (256, 128) if n % b == 0), None)
    if bk is None or bn is None:
        return " and ".join(f"{name}={v} is not a multiple of {m}" for name, v, m, b in
                            (("K", k, 64, bk), ("N", n, 128, bn)) if b is None)
    return dataclasses.replace(WsTgmmConfig(), block_k=bk, block_n=bn, num_sms=num_sms)


def _transposed(ref):
    """The 2-D SMEM ref transposed (a view for ``wgmma``): ``ref.transpose`` where jax has it (0.11 deprecates
    ``plgpu.transpose_ref``), ``plgpu.transpose_ref`` before."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


def tgmm_ws(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, config: WsTgmmConfig | None = None,
            out_dtype=None, interpret: bool = False) -> jax.Array:
    """Grouped weight gradient ``out[g] = lhs[rows of g]^T @ dout[rows of g]`` (warp-specialized Mosaic GPU).

    Args:
      lhs: ``[M, K]`` bf16 / f16, rows sorted by group; dout: ``[M, N]``, same dtype.
      group_sizes: int ``[G]`` rows per group in order (negative sizes count as 0; the sum is clipped to M).
        Rows outside a group are zeroed on the dout side only: a non-finite lhs value in another group's
        rows or in rows past the sum (up to 7 rows before a group's start and the rest of its last block)
        makes this group's gradient NaN (0 * inf), where ``gpu_gmm.tgmm`` reads none of them. M need not
        be a multiple of 8 (the operands are then padded with zero rows: a copy).
      config: ``WsTgmmConfig`` (default ``WsTgmmConfig()``); out_dtype: bf16 / f16 (default lhs.dtype).
      interpret: run in the Mosaic GPU interpreter (any backend, jax >= 0.11; tests). On a CPU pass
        ``config.num_sms`` (the CTAs the interpreter runs).
    Returns: ``[G, K, N]`` in out_dtype, fp32 accumulation; an empty group's matrix is exactly 0 (G = 0:
      an empty array).
    Raises: ValueError on shapes (ranks, M mismatch, K % block_k, N % block_n) or a device without an SM
      count and no ``config.num_sms``; TypeError on dtypes or config;
      NotImplementedError for ``interpret=True`` on a jax without the Mosaic GPU interpreter.
    Math: MegaBlocks (Gale et al. 2022) weight gradient; kernel layout in the module docstring.
    """
    cfg = config or WsTgmmConfig()
    if not isinstance(cfg, WsTgmmConfig):
        raise TypeError(f"config must be a WsTgmmConfig, got {type(cfg).__name__}")
    if lhs.ndim != 2 or dout.ndim != 2 or group_sizes.ndim != 1 or lhs.shape[0] != dout.shape[0]:
        raise ValueError(f"tgmm_ws expects lhs [M, K], dout [M, N], group_sizes [G]; got {lhs.shape}, {dout.shape}, "
                         f"{group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if lhs.dtype != dout.dtype or jnp.dtype(lhs.dtype) not in _DTYPES or out_dtype not in _DTYPES:
        raise TypeError(f"tgmm_ws needs bf16 / f16 lhs and dout of one dtype and a bf16 / f16 output, got "
                        f"{lhs.dtype}, {dout.dtype} -> {out_dtype} (gpu_gmm.tgmm covers fp32)")
    m, kdim = lhs.shape
    ndim = dout.shape[1]
    br, bk, bn, stages = cfg.block_rows, cfg.block_k, cfg.block_n, cfg.stages
    if kdim % bk or ndim % bn:
        raise ValueError(f"tgmm_ws {cfg.label()} needs K % {bk} == 0 and N % {bn} == 0, got K={kdim}, N={ndim} "
                         f"(gpu_gmm.tgmm has no such constraint)")
    interpret_params = mosaic_interpret_params("tgmm_ws") if interpret else None
    g = group_sizes.shape[0]
    bh = bn // 2                                   # columns per compute warpgroup
    nk, nn = kdim // bk, ndim // bn
    num_tiles = g * nk * nn
    if g == 0:
        return jnp.zeros((0, kdim, ndim), out_dtype)
    if m % 8:
        # TMA row offsets into 8-row tiled SMEM must be multiples of 8 and so must M (Mosaic GPU: "dimension 0
        # must have size smaller or a multiple of its tiling 8"): pad with zero rows, which no group owns.
        lhs = jnp.pad(lhs, ((0, 8 - m % 8), (0, 0)))
        dout = jnp.pad(dout, ((0, 8 - m % 8), (0, 0)))
    starts, sizes = group_bounds(group_sizes, m)
    tab = jnp.stack([starts, sizes]).astype(jnp.int32)
    itemsize = jnp.dtype(lhs.dtype).itemsize

    def decode(t):
        gi = lax.div(t, nk * nn)
        r = t - gi * (nk * nn)
        ki = lax.div(r, nn)
        return gi, ki, r - ki * nn

    def body(tab_ref, lhs_ref, dout_ref, out_ref):
        def rows_of(gi):
            """(first row of the first block, steps, live rows [lo, hi) relative to that row)."""
            start, size = tab_ref[0, gi], tab_ref[1, gi]
            a0 = lax.div(start, 8) * 8                 # TMA row offsets into 8-row tiled SMEM: multiples of 8
            lo = start - a0
            nsteps = jnp.where(size > 0, lax.div(lo + size + (br - 1), br), 0)
            return a0, nsteps, lo, lo + size

        def scope(lhs_smem, dout_smem, out_smem, produced, consumed):
            wg = lax.axis_index("wg")

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                @over_tiles(num_tiles, decode)
                def used(gi, ki, ni, carry):
                    a0, nsteps, _, _ = rows_of(gi)

                    def load(s, slot, barrier):
                        rows = pl.ds(pl.multiple_of(a0 + s * br, 8), br)
                        plgpu.copy_gmem_to_smem(lhs_ref.at[rows, pl.ds(ki * bk, bk)], lhs_smem.at[slot], barrier)
                        plgpu.copy_gmem_to_smem(dout_ref.at[rows, pl.ds(ni * bn, bn)], dout_smem.at[slot], barrier)
                    return fill_steps(produced, consumed, stages, nsteps, carry, load)
                drain_steps(consumed, stages, used)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                @over_tiles(num_tiles, decode)
                def _tiles(gi, ki, ni, carry):
                    _, nsteps, lo, hi = rows_of(gi)

                    def acc_scope(acc_ref):
                        def mma(s, slot):
                            d_ref = dout_smem.at[slot, :, pl.ds(wg * bh, bh)]
                            r_lo, r_hi = lo - s * br, hi - s * br          # live rows of this block

                            @pl.when((r_lo > 0) | (r_hi < br))
                            def _mask():
                                x = d_ref[...]
                                idx = lax.broadcasted_iota(jnp.int32, (br, bh), 0)
                                d_ref[...] = jnp.where((idx >= r_lo) & (idx < r_hi), x, jnp.zeros_like(x))
                                plgpu.commit_smem()
                            plgpu.wgmma(acc_ref, _transposed(lhs_smem.at[slot]), d_ref)
                        c_end = mma_steps(produced, consumed, stages, nsteps, carry, mma)
                        return acc_ref[...], c_end

                    acc, c_end = pl.run_scoped(acc_scope, plgpu.ACC((bk, bh), jnp.float32))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)      # the previous tile's store read its SMEM
                    out_smem.at[wg][...] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                            out_ref.at[gi, pl.ds(ki * bk, bk), pl.ds(ni * bn + wg * bh, bh)])
                    return c_end
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scope,
            lhs_smem=plgpu.SMEM((stages, br, bk), lhs.dtype, transforms=mosaic_smem_transforms(bk, itemsize)),
            dout_smem=plgpu.SMEM((stages, br, bn), lhs.dtype, transforms=mosaic_smem_transforms(bh, itemsize)),
            out_smem=plgpu.SMEM((2, bk, bh), out_dtype, transforms=mosaic_smem_transforms(bh, out_dtype.itemsize)),
            produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
        )

    num_sms = cfg.num_sms or getattr(jax.devices()[0], "core_count", None)
    if not num_sms:
        raise ValueError(f"tgmm_ws: {jax.devices()[0].device_kind} reports no SM count; pass WsTgmmConfig(num_sms=...)")
    kernel = plgpu.kernel(
        body,
        out_type=typed_out_struct((g, kdim, ndim), out_dtype, lhs),
        grid=(num_sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg", kernel_name="tgmm_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
    )
    # Inside shard_map, plgpu.kernel returns its output typed invariant whatever out_type says (seen in the
    # Mosaic GPU interpreter, jax 0.11.2); its data is per rank, like lhs: retype it so (a custom VJP needs it).
    return match_vma(kernel(tab, lhs, dout), lhs)
