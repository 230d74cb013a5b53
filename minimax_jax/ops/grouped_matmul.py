"""Grouped matmul for MoE experts: ``out[rows of group g] = lhs[rows of group g] @ rhs[g]``.

Implementations (``implementation=``):
- ``"xla"``: ``jax.lax.ragged_dot``. Runs everywhere and is the reference; on GPU XLA lowers it
  to a slow generic loop (PLATFORM.md: 3-22 TFLOP/s on an H200, and it runs out of memory at MoE
  sizes), on CPU it is exact.
- ``"tokamax"``: ``tokamax.ragged_dot(implementation="mosaic")`` (Mosaic GPU kernels on Hopper,
  Mosaic TPU kernels on TPU), with tokamax's own backward. ``ImplementationUnavailable`` when
  tokamax cannot be imported or the backend is CPU. Opt-in only: on the H200 (bench/moe.py check,
  2026-11-30, tokamax 0.0.17) its weight gradients (its ragged-contraction kernel) were off by 6-8%
  relative Frobenius error against the fp32 reference (``"xla"``: 0.4%); upstream reports the same
  defect (openxla/tokamax issue 887, open: its rhs VJP gives non-zero gradients to empty groups and
  wrong ones to the others).
- ``"pallas_gpu"``: the project's own Pallas kernels with the Triton lowering
  (``pallas_kernels.moe.gpu_gmm.gmm``: grouped matmul forward, transposed grouped matmul for the
  input gradient, per-group transposed matmul for the weight gradient; MegaBlocks-style block-sparse
  grouped GEMM, Gale et al. 2022). GPU backend only (``ImplementationUnavailable`` elsewhere).
  Tile configs: ``pallas_kernels.moe.gpu_gmm.get_default_configs``. H200 check (bench/moe.py,
  2026-11-30, jax 0.11.2, bench/results/moe_run8.log), MoE layer in bf16: relative Frobenius error
  against the fp32 reference y 0.0039, dx 0.0042, d wi 0.0038, d wo 0.0039 (``"xla"``:
  0.0035-0.0042; ``"tokamax"``: 0.063 / 0.080 on the weight gradients). Rates (BENCHMARKS.md, session
  13, 2026-12-02): the two grouped matmuls alone 479-565 TFLOP/s forward and 410-542 forward+backward
  (M2 / M3 expert shapes, 8K-64K tokens; 66-82% / 57-78% of a dense matmul of the same FLOPs), the whole
  MoE layer 424-529 / 397-514; ``"xla"``: 3-22 TFLOP/s.
- ``"pallas_gpu_interpret"``: the same kernels in Pallas interpret mode (any backend; CPU tests).
- ``"auto"``: ``"pallas_gpu"`` on a GPU backend (the numbers above), ``"xla"`` elsewhere (CPU, and
  TPU, where no project kernel exists and tokamax is opt-in).
The resolved name is returned so callers can record it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minimax_jax.ops.common import ImplementationUnavailable, default_backend, match_vma

__all__ = ["GMM_IMPLEMENTATIONS", "resolve_gmm", "grouped_matmul", "tokamax_status", "zeros_past_sum"]

GMM_IMPLEMENTATIONS = ("auto", "xla", "tokamax", "pallas_gpu", "pallas_gpu_interpret")
# implementations whose output rows past sum(group_sizes) are exactly 0 (tested in tests/test_gmm_pallas.py);
# for the others callers mask those rows
_ZEROS_PAST_SUM = frozenset({"pallas_gpu", "pallas_gpu_interpret"})


def zeros_past_sum(implementation: str) -> bool:
    """Whether ``grouped_matmul(..., implementation=...)`` returns exact zeros in the rows past
    ``sum(group_sizes)`` (then a caller need not mask them): True for the Pallas kernels (their tests check
    those rows), False for XLA ``ragged_dot`` and tokamax. Resolves ``"auto"`` first.
    Raises ImplementationUnavailable like ``resolve_gmm``."""
    return resolve_gmm(implementation) in _ZEROS_PAST_SUM


@functools.lru_cache(maxsize=1)
def _tokamax():
    """The tokamax module, or the ImportError text (cached)."""
    try:
        import tokamax  # noqa: PLC0415  (optional dependency, large import)
    except Exception as e:  # tokamax imports xprof etc.; any failure means "not available"
        return f"{type(e).__name__}: {e}"
    return tokamax


def tokamax_status() -> str | None:
    """None when tokamax imports here, else the import error text (cached; CPU-independent)."""
    tk = _tokamax()
    return tk if isinstance(tk, str) else None


def resolve_gmm(implementation: str) -> str:
    """Resolve ``"auto"`` and check availability. Returns one of ``GMM_IMPLEMENTATIONS`` other than
    ``"auto"`` (``"auto"`` resolves to ``"pallas_gpu"`` on a GPU backend, ``"xla"`` elsewhere; module
    docstring).

    Raises ImplementationUnavailable for an unknown name, ``"tokamax"`` where it cannot run, or
    ``"pallas_gpu"`` on a backend other than GPU.
    """
    if implementation not in GMM_IMPLEMENTATIONS:
        raise ImplementationUnavailable(
            f"grouped matmul implementation {implementation!r} is not one of {GMM_IMPLEMENTATIONS}")
    backend = default_backend()
    if implementation == "auto":
        return "pallas_gpu" if backend == "gpu" else "xla"   # module docstring; tokamax is opt-in
    if implementation == "tokamax":
        tk = _tokamax()
        if isinstance(tk, str):
            raise ImplementationUnavailable(f"grouped matmul 'tokamax': cannot import tokamax ({tk})")
        if backend not in ("gpu", "tpu"):
            raise ImplementationUnavailable(f"grouped matmul 'tokamax' needs a GPU or TPU backend, not {backend!r}")
    if implementation == "pallas_gpu" and backend != "gpu":
        raise ImplementationUnavailable(
            f"grouped matmul 'pallas_gpu' (Triton-lowered Pallas kernels) needs a GPU backend, not {backend!r}; "
            "'pallas_gpu_interpret' runs the same kernels in interpret mode")
    return implementation


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, implementation: str = "xla",
                   preferred_element_type=jnp.float32) -> jax.Array:
    """Grouped (ragged) matmul.

    Args:
      lhs: ``[M, K]`` rows sorted by group; rows past ``sum(group_sizes)`` are unspecified in the
        output (callers mask them).
      rhs: ``[G, K, N]`` one matrix per group (cast to ``lhs.dtype``).
      group_sizes: ``[G]`` int32 rows per group, ``sum <= M``.
      implementation: one of ``GMM_IMPLEMENTATIONS`` (``"auto"`` is resolved by ``resolve_gmm``).
    Returns: ``[M, N]`` in ``preferred_element_type``.
    Raises: ImplementationUnavailable (see ``resolve_gmm``).
    """
    impl = resolve_gmm(implementation)
    rhs = rhs.astype(lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    if impl in ("pallas_gpu", "pallas_gpu_interpret"):
        from pallas_kernels.moe.gpu_gmm import gmm  # noqa: PLC0415  (kernels import lazily, like tokamax)

        # Output in lhs.dtype (fp32 accumulation inside), widened outside as for tokamax: the
        # backward kernels then get a cotangent of the operands' dtype, and a bf16 output halves
        # the kernel's store traffic (moe.sorted_expert_mlp narrows h to bf16 right after anyway).
        out = gmm(lhs, rhs, group_sizes, interpret=impl == "pallas_gpu_interpret")
        return out.astype(preferred_element_type)
    if impl == "tokamax":
        # tokamax's backward multiplies the output cotangent with the operands and requires equal
        # dtypes (a float32 cotangent against bf16 weights raises NotImplementedError, seen on the
        # H200 with tokamax 0.0.17), so the kernel returns lhs.dtype (accumulated in f32 inside)
        # and the widening happens outside, where autodiff narrows the cotangent back.
        out = _tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype,
                                    implementation="mosaic")
        # Inside expert-parallel shard_map the pallas_call output comes back invariant-typed; it varies
        # like both operands (the H200 run failed the custom-VJP type check of unpermute_combine).
        return match_vma(match_vma(out, lhs), rhs).astype(preferred_element_type)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
