"""Entry points for ``minimax_jax.decode.ops`` (implementation="pallas_gpu" | "pallas_tpu" | "pallas_interpret").

Each function takes the op's validated arguments plus ``backend``:
  "gpu"           Pallas kernels with the Triton lowering (gpu.py);
  "tpu"           Pallas Mosaic TPU kernels, page tables through scalar prefetch (tpu.py);
  "interpret"     the TPU kernels in Pallas interpret mode (CPU tests);
  "gpu_interpret" the GPU kernels in Pallas interpret mode (CPU tests of the GPU kernel logic).
An unknown backend raises ImplementationUnavailable; there is no fallback. The backend that ran is
recorded under ``"<op>.pallas_backend"`` with ``record_implementation``.
"""

from __future__ import annotations

from minimax_jax.ops.common import ImplementationUnavailable, record_implementation

__all__ = ["page_scores", "select_pages", "paged_attention", "BACKENDS"]

BACKENDS = ("gpu", "tpu", "interpret", "gpu_interpret")


def _check_backend(op: str, backend: str) -> None:
    if backend not in BACKENDS:
        raise ImplementationUnavailable(f"{op}: unknown Pallas backend {backend!r}; expected one of {BACKENDS}")
    record_implementation(f"{op}.pallas_backend", backend)


def page_scores(qi, ki_pages, page_table, q_positions, *, ki_scale=None, backend):
    """Raw page scores ``[B, Hi, Q, NP]`` f32; only pages ``< max_i local_i`` are meaningful.

    Args: qi ``[B,Q,Hi,Di]``, ki_pages ``[P,page,Di]``, page_table ``[B,NP]`` int32, q_positions
      ``[B,Q]`` int32, ki_scale ``[P,page]`` f32 or None, backend (module docstring).
    """
    _check_backend("msa_decode_select", backend)
    if backend in ("gpu", "gpu_interpret"):
        from pallas_kernels.decode.gpu import page_scores_gpu
        return page_scores_gpu(qi, ki_pages, page_table, q_positions, ki_scale, interpret=backend == "gpu_interpret")
    from pallas_kernels.decode.tpu import page_scores_tpu
    return page_scores_tpu(qi, ki_pages, page_table, q_positions, ki_scale, interpret=backend == "interpret")


def select_pages(qi, ki_pages, page_table, q_positions, *, ki_scale=None, topk, init_blocks=0, local_blocks=1,
                 backend):
    """Page selection ``[B, Hi, Q, K]`` int32 (logical ids, -1 padded; MSA_SPEC.md section 5).

    GPU backends: scoring kernel + in-kernel top-(K-1) (no sort). TPU backends: the Mosaic scoring
    kernel, then the selection from the scores in XLA (``jax.lax.top_k``), recorded as
    ``"msa_decode_select.topk": "xla"``.
    """
    _check_backend("msa_decode_select", backend)
    if backend in ("gpu", "gpu_interpret"):
        from pallas_kernels.decode.gpu import select_pages_gpu
        record_implementation("msa_decode_select.topk", "pallas_gpu")
        return select_pages_gpu(qi, ki_pages, page_table, q_positions, ki_scale, topk=topk, init_blocks=init_blocks,
                                local_blocks=local_blocks, interpret=backend == "gpu_interpret")
    from minimax_jax.decode.ops import select_from_page_scores
    from pallas_kernels.decode.tpu import page_scores_tpu
    record_implementation("msa_decode_select.topk", "xla")
    scores = page_scores_tpu(qi, ki_pages, page_table, q_positions, ki_scale, interpret=backend == "interpret")
    return select_from_page_scores(scores, q_positions, ki_pages.shape[1], topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks)


def paged_attention(q, k_pages, v_pages, page_table, q_positions, *, k_scale=None, v_scale=None, block_ids=None,
                    backend, pages_per_split=None):
    """Paged decode attention ``(o [B,Q,H,D], lse [B,Q,H] f32)``; see ``minimax_jax.decode.ops``."""
    _check_backend("paged_attention", backend)
    if backend in ("gpu", "gpu_interpret"):
        from pallas_kernels.decode.gpu import paged_attention_gpu
        return paged_attention_gpu(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale, block_ids,
                                   interpret=backend == "gpu_interpret", pages_per_split=pages_per_split)
    from pallas_kernels.decode.tpu import paged_attention_tpu
    return paged_attention_tpu(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale, block_ids,
                               interpret=backend == "interpret")
