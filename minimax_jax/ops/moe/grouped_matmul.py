"""Grouped matmul for MoE experts, ``out[rows of group g] = lhs[rows of group g] @ rhs[g]``, and the gated
expert MLP built on it (``sorted_expert_mlp``).

Implementations (registry op ``"grouped_matmul"``, ``implementation=``):
- ``"xla"``: ``jax.lax.ragged_dot``. Runs everywhere and is the reference; exact on CPU. On GPU XLA
  lowers it to a slow generic loop that runs out of memory at MoE sizes (see BENCHMARKS.md (MoE)).
- ``"tokamax"``: ``tokamax.ragged_dot(implementation="mosaic")`` (Mosaic GPU kernels on Hopper, Mosaic
  TPU kernels on TPU) with tokamax's own backward; needs tokamax importable and a GPU or TPU backend.
  Opt-in only: its weight gradients are several percent off the fp32 reference (see BENCHMARKS.md (MoE);
  upstream: openxla/tokamax issue 887, its rhs VJP gives non-zero gradients to empty groups and wrong
  ones to the others).
- ``"pallas_gpu"``: the project's Pallas kernels with the Triton lowering (``pallas_kernels.moe.gpu_gmm.gmm``:
  grouped matmul forward, transposed grouped matmul for the input gradient, per-group transposed matmul
  for the weight gradient; the block-sparse grouped GEMM of MegaBlocks, Gale et al. 2022), with the
  tile configs ``gpu_gmm.DEFAULT_CONFIGS``; on Hopper (compute capability 9.x, or no GPU visible: lowering
  for one) the weight gradient runs the warp-specialized Mosaic GPU kernel (``gpu_tgmm_ws``) wherever its
  tiles fit (bf16 / f16, K % 64, N % 128: ``ws_tgmm_config``), the Triton one elsewhere; which one, and why,
  is recorded under ``"grouped_matmul.tgmm"`` (the kernel the weight gradient runs if the call is
  differentiated; the distinct choices since the report was last cleared are joined by "; "). GPU backend only. Accuracy and rates: BENCHMARKS.md (MoE).
- ``"pallas_gpu_interpret"``: the same kernels in Pallas interpret mode (any backend; CPU tests).
- ``"auto"``: ``"pallas_gpu"`` on a GPU backend, ``"xla"`` elsewhere (CPU, and TPU, where no project
  kernel exists and tokamax is opt-in).
FP8 experts (``rhs`` an ``Fp8Weight``, ``fp8_weight.py``): ``"xla"`` dequantises ``FP8_EXPERTS_PER_STEP``
experts at a time inside a scan (one ``ragged_dot`` per chunk; the bf16 copy of a layer's experts never exists
whole); ``"pallas_gpu*"`` reads the FP8 bytes and dequantises each weight tile in the kernel
(``gpu_gmm_fp8.gmm_fp8``: the dequantised copy never exists, half the weight traffic of bf16) when the scale blocks
fit its tiles (``gpu_gmm_fp8.fp8_unsupported``; the published 128 x 128 blocks do), else, like ``"tokamax"``, takes
the layer's experts dequantised to ``lhs.dtype`` (in the same jitted step).
What ran is recorded under ``"grouped_matmul"`` (``minimax_jax.ops.registry.implementation_report``), and for
FP8 experts how they were consumed under ``"grouped_matmul.fp8"``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from minimax_jax.ops import registry
from minimax_jax.ops.moe.activation import GatedActivation
from minimax_jax.ops.moe.fp8_weight import Fp8Weight
from minimax_jax.ops.registry import Implementation, record_implementation
from pallas_kernels.common import gpu_compute_capability, gpu_sm_count, match_vma, needs_byte_pairs
from pallas_kernels.moe.gpu_gmm import gmm
from pallas_kernels.moe.gpu_gmm_fp8 import fp8_config, fp8_unsupported, gmm_fp8
from pallas_kernels.moe.gpu_gmm_gated import gated_config, gmm_gated
from pallas_kernels.moe.gpu_tgmm_ws import ws_tgmm_config

__all__ = ["grouped_matmul", "sorted_expert_mlp", "tokamax_status", "tokamax_supports", "zeros_past_sum"]

OP = "grouped_matmul"
# implementations whose output rows past sum(group_sizes) are exactly 0 (tested in tests/kernels/moe/test_gmm_pallas.py);
# for the others callers mask those rows
_ZEROS_PAST_SUM = frozenset({"pallas_gpu", "pallas_gpu_interpret"})
#: Experts dequantised per step by the ``"xla"`` path for ``Fp8Weight`` experts (the largest divisor of G up to this).
FP8_EXPERTS_PER_STEP = 8


@functools.lru_cache(maxsize=1)
def _tokamax():
    """The tokamax module, or the ImportError text (cached)."""
    try:
        import tokamax  # noqa: PLC0415  (optional dependency, large import: only when asked for)
    except Exception as e:  # tokamax imports xprof etc.; any failure means "not available"
        return f"{type(e).__name__}: {e}"
    return tokamax


def tokamax_status() -> str | None:
    """None when tokamax imports here, else the import error text (cached; CPU-independent)."""
    tk = _tokamax()
    return tk if isinstance(tk, str) else None


def tokamax_supports(*args, **kwargs) -> str | None:
    """The ``supports`` check of the tokamax implementations: None, or why tokamax cannot be used."""
    err = tokamax_status()
    return None if err is None else f"cannot import tokamax ({err})"


def zeros_past_sum(implementation: str) -> bool:
    """Whether ``grouped_matmul(..., implementation=...)`` returns exact zeros in the rows past
    ``sum(group_sizes)`` (then a caller need not mask them): True for the Pallas kernels (their tests check
    those rows), False for XLA ``ragged_dot`` and tokamax. Resolves ``"auto"`` first.
    Raises ImplementationUnavailable for a name that cannot run here (``registry.resolve``)."""
    return registry.resolve(OP, implementation).name in _ZEROS_PAST_SUM


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, implementation: str = "xla",
                   preferred_element_type=jnp.float32) -> jax.Array:
    """Grouped (ragged) matmul.

    Args:
      lhs: ``[M, K]`` rows sorted by group; rows past ``sum(group_sizes)`` are unspecified in the
        output (callers mask them, unless ``zeros_past_sum(implementation)``).
      rhs: ``[G, K, N]`` one matrix per group (cast to ``lhs.dtype``), or an ``Fp8Weight`` of that shape
        (dequantised to ``lhs.dtype`` inside the op, module docstring).
      group_sizes: ``[G]`` int rows per group, ``sum <= M``.
      implementation: a registered name of op ``"grouped_matmul"`` (module docstring).
    Returns: ``[M, N]`` in ``preferred_element_type``.
    Raises: ValueError for shapes that do not fit; ImplementationUnavailable for an unknown name or one
      that cannot run here (the Pallas kernels: float32 / bfloat16 / float16 lhs).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"{OP}: expects lhs [M, K], rhs [G, K, N] and group_sizes [G]; got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}")
    if group_sizes.shape[0] != rhs.shape[0] or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"{OP}: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes {group_sizes.shape} do not fit "
                         f"as [M, K], [G, K, N], [G]")
    if not isinstance(rhs, Fp8Weight):
        rhs = rhs.astype(lhs.dtype)
    return registry.dispatch(OP, implementation, lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=preferred_element_type)


FP8_REPORT = OP + ".fp8"


def _dense_rhs(lhs, rhs, why: str):
    """A kernel's rhs: ``Fp8Weight`` experts dequantised to ``lhs.dtype`` (module docstring), recorded with
    ``why`` under ``FP8_REPORT``."""
    if not isinstance(rhs, Fp8Weight):
        return rhs
    record_implementation(FP8_REPORT, f"dequantised before the kernel ({why})")
    return rhs.astype(lhs.dtype)


def _xla(lhs, rhs, group_sizes, *, preferred_element_type):
    if isinstance(rhs, Fp8Weight):
        record_implementation(FP8_REPORT, f"dequantised {FP8_EXPERTS_PER_STEP} experts per scan step (xla)")
        return _xla_fp8(lhs, rhs, group_sizes, preferred_element_type)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def _xla_fp8(lhs, rhs: Fp8Weight, group_sizes, preferred_element_type):
    """``ragged_dot`` over chunks of ``c`` experts, each dequantised inside the scan step. Chunk ``j`` runs on
    ``c + 1`` groups: a zero matrix for the rows before its experts, then its experts; rows after them are
    masked. Rows past ``sum(group_sizes)`` come out 0."""
    g, k, n = rhs.shape
    c = max(d for d in range(1, min(g, FP8_EXPERTS_PER_STEP) + 1) if g % d == 0)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(lhs.shape[0], dtype=jnp.int32)[:, None]
    w = Fp8Weight(rhs.w.reshape((g // c, c) + rhs.w.shape[1:]),
                  rhs.scale_inv.reshape((g // c, c) + rhs.scale_inv.shape[1:]), rhs.block)
    zero = jnp.zeros((1, k, n), lhs.dtype)

    def step(acc, xs):
        wq, sq, j = xs
        chunk = jnp.concatenate([zero, Fp8Weight(wq, sq, rhs.block).astype(lhs.dtype)], axis=0)
        lo, hi = starts[j * c], ends[j * c + c - 1]
        sizes = jnp.concatenate([lo[None], jax.lax.dynamic_slice(group_sizes, (j * c,), (c,))])
        out = jax.lax.ragged_dot(lhs, chunk, sizes, preferred_element_type=jnp.float32)
        return acc + jnp.where((rows >= lo) & (rows < hi), out, 0.0), None

    # the carry varies like the operands inside shard_map (expert parallelism), as the step's output does
    acc = match_vma(match_vma(match_vma(jnp.zeros((lhs.shape[0], n), jnp.float32), lhs), rhs.w), group_sizes)
    acc, _ = jax.lax.scan(step, acc, (w.w, w.scale_inv, jnp.arange(g // c)))
    return acc.astype(preferred_element_type)


TGMM_REPORT = OP + ".tgmm"


def _tgmm_choice(lhs, rhs, interpret: bool):
    """The weight-gradient config ``"pallas_gpu"`` passes to ``gmm`` (None: the Triton default), recorded under
    ``TGMM_REPORT`` as the kernel the weight gradient runs if the call is differentiated, with the reason when
    it is not the warp-specialized kernel (module docstring)."""
    if interpret:
        why = "interpreted"
    else:
        cc = gpu_compute_capability()
        why = f"compute capability {cc}, not Hopper" if cc is not None and not cc.startswith("9.") else None
    cfg = ws_tgmm_config(lhs.shape[1], rhs.shape[2], lhs.dtype, gpu_sm_count()) if why is None else why
    if isinstance(cfg, str):
        record_implementation(TGMM_REPORT, f"triton ({cfg})")
        return None
    record_implementation(TGMM_REPORT, f"tgmm_ws ({cfg.label()})")
    return cfg


def _fp8_in_kernel_problem(rhs: Fp8Weight, interpret: bool) -> str | None:
    """Why ``"pallas_gpu"`` cannot dequantise these FP8 experts in the kernel (None when it can): blocks that
    split a weight tile, a GPU whose Triton has no e4m3 conversion (compute capability below 8.9), or weights that
    need byte pairs (``needs_byte_pairs``) with an odd N."""
    why = fp8_unsupported(rhs.shape, rhs.block)
    if why is None and needs_byte_pairs(rhs.w) and rhs.shape[-1] % 2:
        why = f"weights {tuple(rhs.shape)}: >= 2**31 one-byte elements with an odd N (no uint16 byte pairs)"
    cc = None if interpret else gpu_compute_capability()
    if why is None and cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 9):
        why = f"compute capability {cc}: Triton converts float8_e4m3fn from 8.9 on"
    return why


def _pallas(interpret: bool):
    def run(lhs, rhs, group_sizes, *, preferred_element_type, gate_fn=None):
        # gate_fn (sorted_expert_mlp only, after _gated_problem): the gated activation in the epilogue
        if isinstance(rhs, Fp8Weight):
            why = _fp8_in_kernel_problem(rhs, interpret)
            if why is None:
                cfg = fp8_config(lhs.shape[0], rhs.shape[0], rhs.block)
                _record_fp8_in_kernel(rhs, cfg)
                return gmm_fp8(lhs, rhs.w, rhs.scale_inv, group_sizes, scale_block=rhs.block, config=cfg,
                               interpret=interpret, gate_fn=gate_fn).astype(preferred_element_type)
            rhs = _dense_rhs(lhs, rhs, why)
        if gate_fn is not None:
            return gmm_gated(lhs, rhs, group_sizes, gate_fn, tgmm_config=_tgmm_choice(lhs, rhs, interpret),
                             interpret=interpret).astype(preferred_element_type)
        # Output in lhs.dtype (fp32 accumulation inside), widened outside as for tokamax: the backward
        # kernels then get a cotangent of the operands' dtype, and a bf16 output halves the kernel's
        # store traffic (sorted_expert_mlp narrows h to bf16 right after anyway).
        return gmm(lhs, rhs, group_sizes, tgmm_config=_tgmm_choice(lhs, rhs, interpret),
                   interpret=interpret).astype(preferred_element_type)
    return run


GATED_REPORT = OP + ".gated"
#: the gated fusion's report (``sorted_expert_mlp``; ``fused_first`` records what ran in each trace)
GATED_FUSED = "fused into the first grouped matmul's epilogue in forward-only calls (FP8 experts: always)"


def _record_fp8_in_kernel(rhs: Fp8Weight, cfg, how: str = "gmm_fp8") -> None:
    """Record under ``FP8_REPORT`` that the kernel (``how``) dequantises ``rhs`` per tile with ``cfg``."""
    pairs = ", weights of >= 2**31 bytes read as uint16 byte pairs" if needs_byte_pairs(rhs.w) else ""
    record_implementation(FP8_REPORT, f"dequantised per tile in the kernel ({how}, {cfg.label()}{pairs})")


def _gated_problem(impl: str, xs, wi, act) -> str | None:
    """Why ``sorted_expert_mlp`` cannot fuse ``act`` into the first grouped matmul's epilogue (None when it can):
    it fuses a ``GatedActivation`` in the Pallas kernels, bf16 / f16 / f32 or in-kernel FP8 experts, I a multiple
    of 16 (FP8: of the kernel's ``bn``)."""
    if impl not in ("pallas_gpu", "pallas_gpu_interpret"):
        return f"grouped matmul {impl!r} has no gated epilogue"
    if not isinstance(act, GatedActivation):
        return "the activation is not a GatedActivation"
    if wi.shape[-1] % 2:
        return f"odd gate/up width {wi.shape[-1]}"
    half = wi.shape[-1] // 2
    if isinstance(wi, Fp8Weight) and _fp8_in_kernel_problem(wi, impl.endswith("interpret")) is None:
        bn = fp8_config(xs.shape[0], wi.shape[0], wi.block).bn
        return None if half % bn == 0 else f"FP8 experts: I = {half} is not a multiple of the kernel's bn = {bn}"
    cfg = gated_config(half)
    return cfg if isinstance(cfg, str) else None


def _pallas_supports(lhs=None, *_, **__) -> str | None:
    """The Pallas kernels multiply float32 / bfloat16 / float16 operands (``rhs`` is cast to ``lhs.dtype``).
    Without operands (``zeros_past_sum`` resolves a name alone) None."""
    ok = lhs is None or any(lhs.dtype == d for d in (jnp.float32, jnp.bfloat16, jnp.float16))
    return None if ok else f"the Pallas kernels take float32 / bfloat16 / float16 operands, got {lhs.dtype}"


def _tokamax_gmm(lhs, rhs, group_sizes, *, preferred_element_type):
    rhs = _dense_rhs(lhs, rhs, "tokamax takes bf16 / f16 weights")
    # tokamax's backward multiplies the output cotangent with the operands and requires equal dtypes (a
    # float32 cotangent against bf16 weights raises NotImplementedError in tokamax 0.0.17), so the kernel
    # returns lhs.dtype (accumulated in f32 inside) and the widening happens outside, where autodiff
    # narrows the cotangent back.
    out = _tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, implementation="mosaic")
    # Inside expert-parallel shard_map the pallas_call output comes back invariant-typed; it varies like
    # both operands (else the custom-VJP type check of unpermute_combine fails).
    return match_vma(match_vma(out, lhs), rhs).astype(preferred_element_type)


registry.register(OP, [
    Implementation("xla", _xla),
    Implementation("tokamax", _tokamax_gmm, platforms=("gpu", "tpu"), supports=tokamax_supports),
    Implementation("pallas_gpu", _pallas(False), platforms=("gpu",), supports=_pallas_supports),
    Implementation("pallas_gpu_interpret", _pallas(True), supports=_pallas_supports),
], auto=lambda backend, *args, **kwargs: ["pallas_gpu", "xla"] if backend == "gpu" else ["xla"])


def sorted_expert_mlp(xs: jax.Array, group_sizes: jax.Array, wi: jax.Array, wo: jax.Array, act: Callable,
                      gmm_impl: str, out_dtype=jnp.float32) -> jax.Array:
    """Gated expert MLP on rows sorted by expert: ``[M, H] -> [M, H]`` in ``out_dtype``.

    Args: ``xs [M, H]`` compute dtype, rows sorted by expert; ``group_sizes [G]`` int32, sum <= M;
      ``wi [G, H, 2I]`` (gate columns first), ``wo [G, I, H]`` (arrays or ``Fp8Weight``); ``act`` maps
      ``[..., 2I] -> [..., I]`` (a ``GatedActivation`` runs in the first Pallas matmul's epilogue in forward-only
      calls, and with FP8 experts dequantised in the kernel always (``gmm_fp8`` recomputes h in its backward), so
      ``h [M, 2I]`` is never written: ``_gated_problem``; recorded under ``"grouped_matmul.gated"``);
      ``gmm_impl`` a grouped-matmul implementation (module docstring); ``out_dtype`` of the result (both
      grouped matmuls accumulate in float32; a caller that narrows the result anyway passes its dtype,
      the values are the same).
    Returns ``[M, H]`` in ``out_dtype``; rows past ``sum(group_sizes)`` are 0 (masked here unless the
    implementation already stores zeros there, ``zeros_past_sum``).
    Raises ImplementationUnavailable for an implementation that cannot run here.
    """
    impl = registry.resolve(OP, gmm_impl, xs, wi, group_sizes, preferred_element_type=xs.dtype).name
    why = _gated_problem(impl, xs, wi, act)
    record_implementation(GATED_REPORT, GATED_FUSED if why is None else f"separate ({why})")
    if why is None:
        a = registry.dispatch(OP, impl, xs, wi if isinstance(wi, Fp8Weight) else wi.astype(xs.dtype),
                              group_sizes.astype(jnp.int32), preferred_element_type=xs.dtype, gate_fn=act.gate_fn)
    else:
        a = act(grouped_matmul(xs, wi, group_sizes, implementation=gmm_impl).astype(xs.dtype))
    y = grouped_matmul(a, wo, group_sizes, implementation=gmm_impl).astype(out_dtype)
    if zeros_past_sum(gmm_impl):
        # the kernels already store exact zeros there: a mask would be a pass over [M, H] in the forward
        # and another over its cotangent (see BENCHMARKS.md (MoE))
        return y
    live = jnp.arange(xs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))
