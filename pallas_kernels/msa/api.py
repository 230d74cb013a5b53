"""Entry points for ``minimax_jax.ops.msa`` (implementation="pallas_gpu" | "pallas_tpu" | "pallas_interpret").

Each function takes the op's arguments plus ``backend``:
  "gpu"           Pallas kernels with the Triton lowering (gpu_attention.py, gpu_indexer.py, gpu_kl.py);
  "tpu"           Pallas Mosaic TPU kernels (tpu_attention.py, tpu_indexer.py, tpu_kl.py);
  "interpret"     the TPU kernels in Pallas interpret mode (runs on CPU; for tests);
  "gpu_interpret" the GPU kernels in Pallas interpret mode (CPU tests of the GPU kernel logic).
An unknown backend, or a function a backend does not provide, raises ImplementationUnavailable;
there is no silent fallback. ``last_backend()`` reports what ran last per op.
Convention the kernels rely on (each segment's keys stored as one contiguous run with positions
increasing by one; queries anywhere): layout.py. They are checked (ValueError) whenever the positions and
segment ids are concrete (eager calls); under jit they cannot be checked and are a precondition.
"""

from __future__ import annotations

import jax

from minimax_jax.ops.common import ImplementationUnavailable, record_implementation

__all__ = ["msa_select_blocks", "msa_attention", "indexer_kl", "supports", "BACKENDS",
           "last_backend"]

BACKENDS = ("gpu", "tpu", "interpret", "gpu_interpret")
_last: dict[str, str] = {}


def last_backend() -> dict[str, str]:
    """{op name: backend} of the kernels traced most recently in this process."""
    return dict(_last)


def _pow2(x):
    return x >= 16 and not (x & (x - 1))


def supports(op, *args, backend, **kwargs):
    """None when the kernel of ``backend`` handles this call of ``op``, else the reason (a string).

    Used by ``implementation="auto"`` in minimax_jax.ops.msa. Checks: the op has a kernel for the
    backend; GPU (Triton) tiles need block_size and the head / index dims to be powers of two >= 16;
    TPU (Mosaic, all three ops incl. indexer_kl) needs block_size % 128 == 0; the dense KL warm-up
    (block_ids=None) has no kernel on either backend;
    the storage layout (layout.py) when positions are concrete (under jit it is a precondition).
    """
    gpu = backend in ("gpu", "gpu_interpret")
    if op not in ("msa_attention", "msa_select_blocks", "indexer_kl"):
        return f"{op}: no Pallas kernel (use xla)"
    blk = kwargs.get("block_size")
    if op == "indexer_kl" and args[4] is None:
        return "indexer_kl: dense warm-up (block_ids=None) has no Pallas kernel"
    if gpu:
        if blk is None or not _pow2(blk):
            return f"block_size must be a power of two >= 16 for the GPU kernels, got {blk}"
        # (q or qi) head dim, plus v / qi dim for the ops that take them (select takes (qi, ki) only).
        dims = (args[0].shape[-1],) if op == "msa_select_blocks" else (args[0].shape[-1], args[2].shape[-1])
        if not all(_pow2(d) for d in dims):
            return f"head / index dims {dims} must be powers of two >= 16 for the GPU kernels"
    elif blk is None or blk % 128:
        return f"block_size must be a multiple of 128 for the TPU kernels, got {blk}"
    try:
        from pallas_kernels.msa import layout
        layout.check_layout(kwargs["q_positions"], kwargs["kv_positions"],
                            kwargs.get("q_segment_ids"), kwargs.get("kv_segment_ids"))
    except ValueError as e:
        return str(e)
    return None


def _check_layout(op, kw):
    from pallas_kernels.msa import layout
    layout.check_layout(kw["q_positions"], kw["kv_positions"], kw.get("q_segment_ids"),
                        kw.get("kv_segment_ids"))


def _check_backend(op, backend):
    if backend not in BACKENDS:
        raise ImplementationUnavailable(f"{op}: unknown Pallas backend {backend!r}; expected one of {BACKENDS}")
    _last[op] = backend
    record_implementation(f"{op}.pallas_backend", backend)


def msa_attention(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                  kv_segment_ids=None, block_size, backend):
    """Block-sparse MSA attention (MSA_SPEC.md section 3) with a Pallas kernel.

    Args: as ``minimax_jax.ops.msa.msa_attention``: q [B,T,H,D], k [B,S,G,D], v [B,S,G,Dv],
      block_ids int [B,G,T,K] (-1 = empty), positions [B,T]/[B,S], segment ids or None, block_size.
      backend: see the module docstring.
    Returns: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32); differentiable in q, k, v (custom_vjp;
      the lse output carries no gradient).
    Raises: ImplementationUnavailable (unknown backend / missing kernel), ValueError (shapes).
    """
    op = "msa_attention"
    _check_backend(op, backend)
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, block_size=block_size)
    _check_layout(op, kw)
    if backend in ("gpu", "gpu_interpret"):
        from pallas_kernels.msa.gpu_attention import msa_attention_gpu
        return msa_attention_gpu(q, k, v, block_ids, interpret=backend == "gpu_interpret", **kw)
    try:
        from pallas_kernels.msa.tpu_attention import msa_attention_tpu
    except ImportError as e:
        raise ImplementationUnavailable(f"{op}: TPU kernel not importable: {e}") from e
    return msa_attention_tpu(q, k, v, block_ids, interpret=backend == "interpret", **kw)


def msa_select_blocks(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                      block_size, topk, init_blocks=0, local_blocks=1, backend):
    """MSA block selection (MSA_SPEC.md sections 1-2) with a fused Pallas indexer kernel.

    Args: as ``minimax_jax.ops.msa.msa_select_blocks``: qi [B,T,Hi,Di], ki [B,S,Di], positions,
      segment ids, block_size, topk, init_blocks, local_blocks; backend: see the module docstring.
    Returns: int32 [B,Hi,T,K] in the reference order (forced non-local blocks ascending, ranked by
      score descending with ties to the lower id, local block last, -1 padding).
    Raises: ImplementationUnavailable, ValueError.
    """
    op = "msa_select_blocks"
    _check_backend(op, backend)
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, block_size=block_size, topk=topk,
              init_blocks=init_blocks, local_blocks=local_blocks)
    _check_layout(op, kw)
    # Block ids are integers: no gradient flows through selection. Stopping it here keeps autodiff
    # from differentiating the pallas_call (which has no JVP rule: "grid_context" assertion under
    # jax.grad in training, seen on the H200).
    qi, ki = jax.lax.stop_gradient(qi), jax.lax.stop_gradient(ki)
    if backend in ("gpu", "gpu_interpret"):
        from pallas_kernels.msa.gpu_indexer import msa_select_blocks_gpu
        return msa_select_blocks_gpu(qi, ki, interpret=backend == "gpu_interpret", **kw)
    try:
        from pallas_kernels.msa.tpu_indexer import msa_select_blocks_tpu
    except ImportError as e:
        raise ImplementationUnavailable(f"{op}: TPU kernel not importable: {e}") from e
    return msa_select_blocks_tpu(qi, ki, interpret=backend == "interpret", **kw)


def indexer_kl(q, k, qi, ki, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
               kv_segment_ids=None, block_size=None, backend):
    """Indexer KL loss on the selected support (MSA_SPEC.md section 4) with Pallas kernels.

    Args: as ``minimax_jax.ops.msa.indexer_kl`` (q [B,T,H,D], k [B,S,G,D], qi [B,T,G,Di],
      ki [B,S,Di], block_ids int [B,G,T,K], positions, segment ids, block_size) plus backend:
      "gpu" / "gpu_interpret" -> gpu_kl.indexer_kl_gpu; "tpu" / "interpret" ->
      tpu_kl.indexer_kl_tpu.
    Returns (kl_sum f32 [], count int32 []); gradients reach qi and ki only (q, k get zeros).
    Raises: ImplementationUnavailable for block_ids=None (dense warm-up; use implementation="xla")
      or an unknown backend; ValueError for bad shapes or a storage layout the kernels cannot use.
    """
    op = "indexer_kl"
    _check_backend(op, backend)
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids)
    _check_layout(op, kw)
    if backend in ("gpu", "gpu_interpret"):
        from pallas_kernels.msa.gpu_kl import indexer_kl_gpu
        return indexer_kl_gpu(q, k, qi, ki, block_ids, block_size=block_size,
                              interpret=backend == "gpu_interpret", **kw)
    try:
        from pallas_kernels.msa.tpu_kl import indexer_kl_tpu
    except ImportError as e:
        raise ImplementationUnavailable(f"{op}: TPU kernel not importable: {e}") from e
    return indexer_kl_tpu(q, k, qi, ki, block_ids, block_size=block_size,
                          interpret=backend == "interpret", **kw)
