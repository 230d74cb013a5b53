"""Entry points for ``minimax_jax.ops.msa`` (implementation="pallas_gpu" | "pallas_tpu" | "pallas_interpret").

Each function takes the op's arguments plus ``backend``:
  "gpu"           Pallas kernels with the Triton lowering (gpu_attention.py, gpu_indexer.py);
  "tpu"           Pallas Mosaic TPU kernels (tpu_attention.py, tpu_indexer.py);
  "interpret"     the TPU kernels in Pallas interpret mode (runs on CPU; for tests);
  "gpu_interpret" the GPU kernels in Pallas interpret mode (CPU tests of the GPU kernel logic).
An unknown backend, or a function a backend does not provide, raises ImplementationUnavailable;
there is no silent fallback. ``last_backend()`` reports what ran last per op.
Conventions the kernels rely on (queries are the last T keys; segments contiguous): layout.py.
"""

from __future__ import annotations

from minimax_jax.ops.common import ImplementationUnavailable, record_implementation

__all__ = ["msa_select_blocks", "msa_attention", "indexer_kl", "BACKENDS", "last_backend"]

BACKENDS = ("gpu", "tpu", "interpret", "gpu_interpret")
_last: dict[str, str] = {}


def last_backend() -> dict[str, str]:
    """{op name: backend} of the kernels traced most recently in this process."""
    return dict(_last)


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
    """Indexer KL loss (MSA_SPEC.md section 4) with Pallas kernels.

    Raises: ImplementationUnavailable until a kernel exists for ``backend`` (use "xla").
    """
    op = "indexer_kl"
    _check_backend(op, backend)
    try:
        from pallas_kernels.msa import kl as _kl
    except ImportError as e:
        raise ImplementationUnavailable(
            f"{op}: no Pallas indexer-KL kernel for backend {backend!r} yet ({e}); use implementation='xla'") from e
    return _kl.indexer_kl(q, k, qi, ki, block_ids, q_positions=q_positions, kv_positions=kv_positions,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          block_size=block_size, backend=backend)
