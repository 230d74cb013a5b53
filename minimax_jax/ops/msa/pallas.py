"""The Pallas kernel implementations of the MSA ops, for the registry (``minimax_jax.ops.msa.api``).

Each implementation is a thin wrapper over a kernel of ``pallas_kernels.msa`` called with the op's
validated arguments (segment ids always arrays; ``chunk_size`` tunes only the XLA reference and is
dropped here), plus a ``supports`` check that says when the kernel cannot serve a call:
- GPU (Triton) kernels: ``block_size`` and the head / index dims powers of two >= 16 (tile sizes);
- TPU (Mosaic) kernels: ``block_size % 128 == 0`` (lane-dense key tiles); in interpret mode the
  attention and KL kernels take any multiple of 8;
- ``indexer_kl``'s dense warm-up (``block_ids=None``): the GPU implementations run
  ``pallas_kernels.msa.gpu_kl_dense`` (head / index dims powers of two in [16, 256], q / k and qi / ki each
  one dtype; no block size, no layout contract: any T and S, visibility per element; it also serves
  prefix-tree visibility ``kv_subtree_end`` and ``q_weights``); the TPU kernels have no dense warm-up;
- every other kernel: T <= S, and the storage layout of ``pallas_kernels.msa.layout`` (each segment's keys
  one contiguous run, positions increasing by one), checked when the positions are concrete (under
  ``jit`` it is a precondition).
Names: ``pallas_gpu`` / ``pallas_tpu`` (compiled, on their platform) and ``pallas_gpu_interpret`` /
``pallas_tpu_interpret`` (the same kernels in Pallas interpret mode, any platform; CPU tests).
``pallas_hopper_gpu``: the Hopper set (compute capability 9.x; Pallas Mosaic GPU, ``wgmma`` + TMA) where
one is built, the ``pallas_gpu`` (Triton) kernels for the rest: the indexer (``gpu_indexer_wgmma``,
qi and ki of one dtype, bf16 / f16, Hi dividing 64, Di a multiple of 64 up to 256, blocks of 64 / 128 /
256), the attention forward (``gpu_sparse_fwd_qtile.sparse_fwd_hopper``: query tiles where the call's selections
overlap between neighbouring tokens and H/G is 8, 16, 32 or 64, else the KV-outer ``gpu_sparse_fwd_wgmma``,
chosen on the device per call and recorded under ``"msa_attention.forward"``; bf16 / f16, up to 64 heads per group filling at
least 3/4 of its padded head slots: 6-8, 12-16, 24-32, 48-64; D = Dv in {64, 128}, blocks of 64 / 128)
with the backward of ``gpu_sparse_bwd_wgmma`` (bf16 / f16, D = Dv = 128, block 128; ``hopper_backward("triton")``
selects the Triton one; the backward that was traced is recorded under ``"msa_attention.backward"``), and the
Triton indexer KL; a
call outside those shapes is refused with the reason (``"auto"`` then takes ``pallas_gpu``).
``pallas_hopper_gpu_interpret`` runs the same set in the Mosaic GPU interpreter (jax >= 0.11) and Pallas'
interpret mode. Without a visible GPU (lowering for CUDA under ``assume_backend("gpu")``) the Hopper
target is assumed.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from minimax_jax.ops.registry import Implementation, record_implementation
from pallas_kernels.common import (gpu_compute_capability, mosaic_interpreter_available,
                                   mosaic_interpreter_pool_reason)
from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_attention import msa_attention_gpu
from pallas_kernels.msa.gpu_indexer import msa_select_blocks_gpu
from pallas_kernels.msa.gpu_indexer_wgmma import msa_select_blocks_wgmma, wgmma_indexer_supported
from pallas_kernels.msa.gpu_sparse_bwd_wgmma import wgmma_bwd_supported
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import head_slot, wgmma_supported
from pallas_kernels.msa.gpu_kl import indexer_kl_gpu
from pallas_kernels.msa.gpu_kl_dense import dense_unsupported_reason, indexer_kl_dense_gpu
from pallas_kernels.msa.tpu_attention import msa_attention_tpu
from pallas_kernels.msa.tpu_indexer import msa_select_blocks_tpu
from pallas_kernels.msa.tpu_kl import indexer_kl_tpu

__all__ = ["SELECT_BLOCKS", "ATTENTION", "INDEXER_KL", "hopper_backward", "BACKWARD_REPORT", "FORWARD_REPORT"]

BACKWARD_REPORT = "msa_attention.backward"
FORWARD_REPORT = "msa_attention.forward"
_HOPPER_BACKWARD = {"kernel": "wgmma"}


@contextlib.contextmanager
def hopper_backward(kernel: str):
    """Within the block, ``pallas_hopper_gpu`` (and its interpreted twin) trace ``msa_attention`` with the
    backward ``kernel``: ``"wgmma"`` (the default, ``gpu_sparse_bwd_wgmma``; where its ``wgmma_bwd_supported``
    refuses the shapes the Triton one runs) or ``"triton"`` (``gpu_sparse_bwd``).
    Read when a call is traced: a function jitted before the block keeps the backward it was traced with. The
    choice is process-wide (not per thread) while the block is open.
    What was traced is recorded under ``BACKWARD_REPORT``. Raises ValueError for another name."""
    if kernel not in ("triton", "wgmma"):
        raise ValueError(f"hopper_backward: kernel must be 'triton' or 'wgmma', got {kernel!r}")
    prev = _HOPPER_BACKWARD["kernel"]
    _HOPPER_BACKWARD["kernel"] = kernel
    try:
        yield
    finally:
        _HOPPER_BACKWARD["kernel"] = prev


# ----------------------------------------------------------------------------- supports

def _pow2(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def _layout_reason(kw) -> str | None:
    t, s = kw["q_positions"].shape[1], kw["kv_positions"].shape[1]
    if t > s:
        return f"the MSA kernels need at most as many queries as keys, got T={t} > S={s}"
    try:
        layout.check_layout(kw["q_positions"], kw["kv_positions"], kw.get("q_segment_ids"),
                            kw.get("kv_segment_ids"))
    except ValueError as e:
        return str(e)
    return None


def _gpu_supports(dims_of, *args, **kw):
    """Triton tiles: block_size and the dims ``dims_of(args)`` powers of two >= 16; the layout."""
    blk = kw.get("block_size")
    if blk is None or not _pow2(blk):
        return f"block_size must be a power of two >= 16 for the GPU kernels, got {blk}"
    dims = dims_of(args)
    if not all(_pow2(d) for d in dims):
        return f"head / index dims {dims} must be powers of two >= 16 for the GPU kernels"
    return _layout_reason(kw)


def _tpu_supports(multiple, *args, **kw):
    """Mosaic tiles: block_size a multiple of ``multiple`` (None: any); the layout."""
    blk = kw.get("block_size")
    if multiple is not None and (blk is None or blk % multiple):
        return f"block_size must be a multiple of {multiple} for the TPU kernels, got {blk}"
    return _layout_reason(kw)


def _sparse_only(check):
    """``check`` for the TPU indexer_kl, after refusing the dense warm-up (block_ids=None: no TPU kernel)."""
    def supports(*args, **kw):
        if args[4] is None:
            return "indexer_kl: dense warm-up (block_ids=None) has no Pallas TPU kernel"
        return check(*args, **kw)
    return supports


def _hopper_device(interpret: bool) -> str | None:
    """Why the Hopper kernels cannot run here (None when they can): compiled, a visible GPU must be of
    compute capability 9.x (none visible: lowering for the Hopper target); interpreted, jax >= 0.11."""
    if interpret:
        if not mosaic_interpreter_available():
            return "the Mosaic GPU interpreter needs jax >= 0.11"
        return mosaic_interpreter_pool_reason()
    cc = gpu_compute_capability()
    if cc is not None and not str(cc).startswith("9."):
        return f"the wgmma kernels need a Hopper GPU (compute capability 9.x), got {cc}"
    return None


def _hopper_supports(interpret, kernel_reason, triton_check):
    """The Hopper set's check: device, the wgmma kernel's shapes (``kernel_reason(args, kw)``, None for
    an op served by Triton kernels alone), then the Triton kernels' check (layout, and backward tiles)."""
    def supports(*args, **kw):
        why = _hopper_device(interpret)
        if why is None and kernel_reason is not None:
            why = kernel_reason(args, kw)
        return why if why is not None else triton_check(*args, **kw)
    return supports


def _indexer_shapes(args, kw):
    qi, ki = args[:2]
    if ki.dtype != qi.dtype:
        return f"qi and ki dtypes differ ({qi.dtype}, {ki.dtype})"
    if jnp.dtype(qi.dtype) == jnp.dtype(jnp.float8_e4m3fn):
        return ("float8 index inputs need their scales: call gpu_indexer_wgmma.msa_select_blocks_wgmma "
                "with index_dtype='float8_e4m3fn' on bf16 / f16 inputs")
    return wgmma_indexer_supported(qi.shape, ki.shape, qi.dtype, kw.get("block_size"))


def _attention_shapes(args, kw):
    q, k, v = args[:3]
    why = wgmma_supported(q.shape, k.shape, v.shape[-1], q.dtype, kw.get("block_size"))
    if why is None and not (k.dtype == q.dtype == v.dtype):
        why = f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    hg = q.shape[2] // k.shape[2]
    if why is None and 4 * hg < 3 * head_slot(hg):
        # measured (BENCHMARKS.md): 4 heads per group in 8-row slots run 26 % slower than the Triton forward
        why = (f"{hg} heads per group fill {hg} of the wgmma forward's {head_slot(hg)}-row head slots "
               f"(under 3/4): the Triton forward is faster")
    return why


_select_dims = lambda args: (args[0].shape[-1],)                          # qi
_main_dims = lambda args: (args[0].shape[-1], args[2].shape[-1])          # (q, v) or (q, qi)


# ----------------------------------------------------------------------------- kernels

def _select_gpu(qi, ki, *, chunk_size, interpret, **kw):
    # Block ids are integers: stopping the gradient keeps autodiff out of the pallas_call, which
    # has no JVP rule (a "grid_context" assertion under jax.grad in training otherwise).
    qi, ki = jax.lax.stop_gradient(qi), jax.lax.stop_gradient(ki)
    return msa_select_blocks_gpu(qi, ki, interpret=interpret, **kw)


def _select_tpu(qi, ki, *, chunk_size, interpret, **kw):
    qi, ki = jax.lax.stop_gradient(qi), jax.lax.stop_gradient(ki)
    return msa_select_blocks_tpu(qi, ki, interpret=interpret, **kw)


def _select_hopper(qi, ki, *, chunk_size, interpret, **kw):
    qi, ki = jax.lax.stop_gradient(qi), jax.lax.stop_gradient(ki)
    return msa_select_blocks_wgmma(qi, ki, interpret=interpret, **kw)


def _attention_gpu(q, k, v, block_ids, *, chunk_size, interpret, forward="triton", **kw):
    return msa_attention_gpu(q, k, v, block_ids, interpret=interpret, forward=forward, **kw)


def _attention_hopper(q, k, v, block_ids, *, chunk_size, interpret, **kw):
    """The Hopper forward with the backward chosen by ``hopper_backward`` (recorded: module docstring)."""
    backward = "triton"
    if _HOPPER_BACKWARD["kernel"] == "triton":
        record_implementation(BACKWARD_REPORT, "triton (chosen with hopper_backward('triton'))")
    else:
        why = wgmma_bwd_supported(q.shape, k.shape, v.shape[-1], q.dtype, kw["block_size"])
        if why is None:
            backward = "wgmma"
            partials = "bf16" if q.dtype == jnp.bfloat16 else "f32"     # sparse_bwd_wgmma's default
            record_implementation(BACKWARD_REPORT, f"wgmma (default; dq partials in {partials}; triton on a query "
                                                   "pass with a window off an 8-row boundary)")
        else:
            record_implementation(BACKWARD_REPORT, f"triton (the wgmma backward refused: {why})")
    if head_slot(q.shape[2] // k.shape[2]) == q.shape[2] // k.shape[2]:
        record_implementation(FORWARD_REPORT, "hopper: query tiles where the tiles' unions of selected windows "
                                              "are small and every window 8-row aligned, else KV-outer (chosen on "
                                              "the device per call: gpu_sparse_fwd_qtile.use_query_tiles)")
    else:
        record_implementation(FORWARD_REPORT, "KV-outer (padded head slots: no query tiles)")
    return msa_attention_gpu(q, k, v, block_ids, interpret=interpret, forward="hopper", backward=backward, **kw)


def _attention_tpu(q, k, v, block_ids, *, chunk_size, interpret, **kw):
    return msa_attention_tpu(q, k, v, block_ids, interpret=interpret, **kw)


def _kl_gpu(q, k, qi, ki, block_ids, *, chunk_size, interpret, **kw):
    """The sparse GPU KL (``gpu_kl``), or for the dense warm-up (``block_ids=None``: no ``teacher_lse``, the op
    refuses it; ``block_size`` unused) the dense one (``gpu_kl_dense``, which also takes ``kv_subtree_end``)."""
    if block_ids is None:
        kw.pop("block_size", None)
        return indexer_kl_dense_gpu(q, k, qi, ki, interpret=interpret, **kw)
    return indexer_kl_gpu(q, k, qi, ki, block_ids, interpret=interpret, **kw)


def _kl_gpu_supports(*args, **kw):
    """The GPU KL's check: the dense warm-up by ``dense_unsupported_reason`` (tree rows and weights taken), the
    sparse support by the Triton kernels' (``_gpu``: no prefix trees, weights taken)."""
    if args[4] is None:
        why = dense_unsupported_reason(*args[:4])
        return None if why is None else f"indexer_kl (dense warm-up): {why}"
    return _no_tree(_gpu, weights=True)(*args, **kw)


def _kl_tpu(q, k, qi, ki, block_ids, *, chunk_size, interpret, teacher_lse=None, **kw):
    return indexer_kl_tpu(q, k, qi, ki, block_ids, interpret=interpret, **kw)      # computes its own LSE


def _no_tree(check, weights: bool = False):
    """``check`` that also refuses prefix-tree visibility (``kv_subtree_end``: only ``"xla"`` serves it) and,
    unless ``weights`` (the GPU KL kernels), weighted KL rows (``q_weights``)."""
    def supports(*args, kv_subtree_end=None, q_weights=None, **kw):
        if kv_subtree_end is not None:
            return "prefix-tree visibility (kv_subtree_end) is served only by 'xla'"
        if q_weights is not None and not weights:
            return "weighted KL rows (q_weights) are served by 'xla' and the GPU KL kernels"
        return None if check is None else check(*args, **kw)
    return supports


def _four(gpu_fn, tpu_fn, gpu_check, tpu_check, tpu_interpret_check):
    """The op's kernels in registry order: pallas_gpu, pallas_tpu, pallas_tpu_interpret, pallas_gpu_interpret
    (``INDEXER_KL`` lists its own: the GPU KL takes ``q_weights``, and trees in the dense warm-up)."""
    p = functools.partial
    gpu_check = _no_tree(gpu_check)
    tpu_check, tpu_interpret_check = _no_tree(tpu_check), _no_tree(tpu_interpret_check)
    return [Implementation("pallas_gpu", p(gpu_fn, interpret=False), ("gpu",), gpu_check),
            Implementation("pallas_tpu", p(tpu_fn, interpret=False), ("tpu",), tpu_check),
            Implementation("pallas_tpu_interpret", p(tpu_fn, interpret=True), None, tpu_interpret_check),
            Implementation("pallas_gpu_interpret", p(gpu_fn, interpret=True), None, gpu_check)]


def _hopper(fn, kernel_reason, triton_check):
    """The Hopper set's two implementations: pallas_hopper_gpu and pallas_hopper_gpu_interpret."""
    p = functools.partial
    return [Implementation("pallas_hopper_gpu", p(fn, interpret=False), ("gpu",),
                           _no_tree(_hopper_supports(False, kernel_reason, triton_check))),
            Implementation("pallas_hopper_gpu_interpret", p(fn, interpret=True), None,
                           _no_tree(_hopper_supports(True, kernel_reason, triton_check)))]


_gpu = functools.partial(_gpu_supports, _main_dims)
_gpu_select = functools.partial(_gpu_supports, _select_dims)
SELECT_BLOCKS = [*_four(_select_gpu, _select_tpu, _gpu_select, functools.partial(_tpu_supports, 128),
                        functools.partial(_tpu_supports, None)),
                 *_hopper(_select_hopper, _indexer_shapes, lambda *args, **kw: _layout_reason(kw))]
ATTENTION = [*_four(_attention_gpu, _attention_tpu, _gpu, functools.partial(_tpu_supports, 128),
                    functools.partial(_tpu_supports, 8)),
             *_hopper(_attention_hopper, _attention_shapes, _gpu)]
_kl_tpu_checks = [_sparse_only(_no_tree(functools.partial(_tpu_supports, m))) for m in (128, 8)]
INDEXER_KL = [Implementation("pallas_gpu", functools.partial(_kl_gpu, interpret=False), ("gpu",), _kl_gpu_supports),
              Implementation("pallas_tpu", functools.partial(_kl_tpu, interpret=False), ("tpu",), _kl_tpu_checks[0]),
              Implementation("pallas_tpu_interpret", functools.partial(_kl_tpu, interpret=True), None,
                             _kl_tpu_checks[1]),
              Implementation("pallas_gpu_interpret", functools.partial(_kl_gpu, interpret=True), None,
                             _kl_gpu_supports),
              # the Hopper set runs the Triton KL kernels (sparse and dense), after its device check
              Implementation("pallas_hopper_gpu", functools.partial(_kl_gpu, interpret=False), ("gpu",),
                             _hopper_supports(False, None, _kl_gpu_supports)),
              Implementation("pallas_hopper_gpu_interpret", functools.partial(_kl_gpu, interpret=True), None,
                             _hopper_supports(True, None, _kl_gpu_supports))]
