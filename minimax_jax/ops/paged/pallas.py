"""The Pallas kernel implementations of the paged decode ops, for the registry (``minimax_jax.ops.paged.api``).

Each implementation is a thin wrapper over a kernel of ``pallas_kernels.decode`` called with the op's
validated arguments, plus a ``supports`` check:
- ``paged_attention``: sliding windows are xla-only (no kernel has one); GPU shared sparse tiles record
  where their page union came from under ``"paged_attention.union"`` ("kernel (pairwise)", "kernel
  (bitmap)" or "xla");
- ``msa_decode_select``: every kernel serves every call. GPU: the scoring kernel plus the in-kernel
  top-k (``"msa_decode_select.topk": "pallas_gpu"``); rows whose local page is ``< topk`` get pages
  ``0..local`` unscored (``"msa_decode_select.short_rows": "unscored"``); TPU: the Mosaic scoring
  kernel, then the selection from the scores in XLA (``jax.lax.top_k``; ``"msa_decode_select.topk":
  "xla"``, ``"msa_decode_select.short_rows": "scored"``).
The GPU kernels take the op's ``launch_table`` (``pallas_kernels.decode.gpu_config.LaunchTable``;
None = its ``DEFAULT_TABLE``); the TPU kernels have none and ignore it.
Names: ``pallas_gpu`` (Triton) / ``pallas_tpu`` (Mosaic, page tables via scalar prefetch), compiled
on their platform, and ``pallas_gpu_interpret`` / ``pallas_tpu_interpret`` (the same kernels in
Pallas interpret mode, any platform; CPU tests).
"""

from __future__ import annotations

import functools

from minimax_jax.ops.paged.xla import select_from_page_scores
from minimax_jax.ops.registry import Implementation, record_implementation
from pallas_kernels.common import needs_byte_pairs
from pallas_kernels.decode.gpu_attention import paged_attention_gpu, tile_kernel_choice, union_choice
from pallas_kernels.decode.gpu_select import select_pages_gpu
from pallas_kernels.decode.tpu import page_scores_tpu, paged_attention_tpu

__all__ = ["PAGED_ATTENTION", "DECODE_SELECT"]

# what runs for 1-byte caches of 2**31 - 2**32 elements (pallas_kernels.common.needs_byte_pairs)
_PAIRS = "fp8 cache read as uint16 byte pairs (an XLA bitcast; int32 Triton offsets)"


def _no_window(*args, sliding_window=None, **kw) -> str | None:
    return None if sliding_window is None else "sliding windows are xla-only"


def _attention_gpu(q, k_pages, v_pages, page_table, q_positions, *, k_scale, v_scale, block_ids, sliding_window,
                   pages_per_split, launch_table, interpret):
    _, nq, h, d = q.shape
    choice = tile_kernel_choice(nq, h, k_pages.shape[0], d, k_pages.dtype, q.dtype, k_pages.shape[2],
                                has_scale=k_scale is not None, sparse=block_ids is not None, table=launch_table,
                                interpret=interpret)
    record_implementation("paged_attention.tile_kernel", choice)
    union = None if block_ids is None else union_choice(nq, h, k_pages.shape[0], block_ids.shape[-1],
                                                         page_table.shape[1], table=launch_table)
    if union is not None:
        record_implementation("paged_attention.union", union)
    if choice.startswith("triton") and needs_byte_pairs(k_pages):
        record_implementation("paged_attention.byte_pairs", _PAIRS)
    return paged_attention_gpu(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale, block_ids,
                               interpret=interpret, pages_per_split=pages_per_split, table=launch_table)


def _attention_tpu(q, k_pages, v_pages, page_table, q_positions, *, k_scale, v_scale, block_ids, sliding_window,
                   pages_per_split, launch_table, interpret):
    return paged_attention_tpu(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale, block_ids,
                               interpret=interpret)


def _select_gpu(qi, ki_pages, page_table, q_positions, *, ki_scale, topk, init_blocks, local_blocks, launch_table,
                interpret):
    record_implementation("msa_decode_select.topk", "pallas_gpu")
    record_implementation("msa_decode_select.short_rows", "unscored")
    if needs_byte_pairs(ki_pages):
        record_implementation("msa_decode_select.byte_pairs", _PAIRS)
    return select_pages_gpu(qi, ki_pages, page_table, q_positions, ki_scale, topk=topk, init_blocks=init_blocks,
                            local_blocks=local_blocks, interpret=interpret, table=launch_table)


def _select_tpu(qi, ki_pages, page_table, q_positions, *, ki_scale, topk, init_blocks, local_blocks, launch_table,
                interpret):
    record_implementation("msa_decode_select.topk", "xla")
    record_implementation("msa_decode_select.short_rows", "scored")
    scores = page_scores_tpu(qi, ki_pages, page_table, q_positions, ki_scale, interpret=interpret)
    return select_from_page_scores(scores, q_positions, ki_pages.shape[1], topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks)


def _four(gpu_fn, tpu_fn, supports=None):
    """The op's kernels in registry order: pallas_gpu, pallas_tpu, pallas_tpu_interpret, pallas_gpu_interpret."""
    p = functools.partial
    return [Implementation("pallas_gpu", p(gpu_fn, interpret=False), ("gpu",), supports),
            Implementation("pallas_tpu", p(tpu_fn, interpret=False), ("tpu",), supports),
            Implementation("pallas_tpu_interpret", p(tpu_fn, interpret=True), None, supports),
            Implementation("pallas_gpu_interpret", p(gpu_fn, interpret=True), None, supports)]


PAGED_ATTENTION = _four(_attention_gpu, _attention_tpu, _no_window)
DECODE_SELECT = _four(_select_gpu, _select_tpu)
