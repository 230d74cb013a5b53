"""The attention of an MSA layer: block selection, sparse attention and the indexer KL over the layer's
own tokens, for ordinary (packed) rows and for prefix-tree rows (``minimax_jax.data.prefix_tree``).

Prefix-tree rows come two ways:
- ``tree_keys`` (the packer's ``KEY_KEYS``, ``data.key_len``): keys, values and index keys are gathered
  into one run per trajectory (``key_slot``), so each query sees its own trajectory as an ordinary
  document at its own positions; queries keep the row's slots (``query_segment_ids`` names their
  trajectory). Every MSA implementation serves the selection and attention (kernels included). The KL
  rows are the merged queries weighted by ``input_weight`` (a shared input's KL is the same in every
  trajectory through it) where the KL implementation takes weights (the XLA reference, the GPU kernels);
  for the TPU kernels they are the gathered key rows themselves, each trajectory's inputs once (the
  unmerged KL, about tokens-unmerged / tokens-merged times the work).
- ``subtree_end`` alone: tree visibility inside the ops, ``input_weight`` weighting the KL rows (only the
  XLA reference serves it).
Either way the loss, the KL and every gradient equal those of the unmerged trajectories.
"""

from __future__ import annotations

import jax

from minimax_jax.config import ModelConfig
from minimax_jax.ops.attention import attention

__all__ = ["msa_block"]


def _gather(x, slot):
    """``x [B, T, ...]`` gathered along T by ``slot [B, S]`` -> ``[B, S, ...]``."""
    return jax.vmap(lambda xb, sb: xb[sb])(x, slot)


def _dense_kl_impl(cfg: ModelConfig) -> str:
    """The dense warm-up KL's implementation: ``cfg.msa_impl``, except the TPU kernels' (they have no dense warm-up,
    ``minimax_jax.ops.msa.pallas``), for which the XLA reference; on GPU the dense kernels of
    ``pallas_kernels.msa.gpu_kl_dense`` (``"auto"`` too). What ran is recorded under ``"indexer_kl"``."""
    return "xla" if cfg.msa_impl.startswith("pallas_tpu") else cfg.msa_impl


def _kl_takes_weights(cfg: ModelConfig, indexer_kl: str) -> bool:
    """Whether the KL implementation these rows get takes ``q_weights``: the XLA reference and the GPU kernels
    do, the TPU kernels not (``minimax_jax.ops.msa.pallas``); the dense warm-up runs one of the former
    (``_dense_kl_impl``)."""
    impl = cfg.msa_impl
    if indexer_kl == "dense" or impl == "xla":
        return True
    if impl == "auto":
        return jax.default_backend() != "tpu"
    return not impl.startswith("pallas_tpu")


def msa_block(q, k, v, qi, ki, cfg: ModelConfig, positions, segment_ids, indexer_kl: str | None, *,
              subtree_end=None, input_weight=None, tree_keys=None, kv_positions=None, kv_segment_ids=None):
    """MSA attention of one layer (module docstring).

    Args:
      q ``[B,T,H,D]``, k / v ``[B,T,G,D]``, qi ``[B,T,G,Di]``, ki ``[B,T,Di]``: the layer's projections.
      positions, segment_ids: ``[B,T]`` int32. indexer_kl: None, "sparse" or "dense" (warm-up: dense
        main-branch attention, KL over the whole causal history).
      kv_positions, kv_segment_ids: ``[B,S]`` of the keys when they are not the queries' own tokens
        (context parallelism: local queries, gathered keys; ``k``, ``v``, ``ki`` then have S rows).
      subtree_end, input_weight, tree_keys: prefix-tree rows (module docstring), or None.
    Returns: ``(o [B,T,H,D], kl_sum, kl_count, block_ids or None, lse or None)``.
    """
    from minimax_jax.ops import msa as msa_ops  # imported only when a model has MSA layers

    blk = cfg.index_block_size
    rows = dict(q_positions=positions, kv_positions=positions if kv_positions is None else kv_positions,
                q_segment_ids=segment_ids, kv_segment_ids=segment_ids if kv_segment_ids is None else kv_segment_ids)
    tree = {} if subtree_end is None else {"kv_subtree_end": subtree_end}
    unmerged_kl = False
    if tree_keys is not None:
        slot = tree_keys["key_slot"]
        kpos, kseg = tree_keys["key_positions"], tree_keys["key_segment_ids"]
        sel = dict(q_positions=positions, q_segment_ids=tree_keys["query_segment_ids"], kv_positions=kpos,
                   kv_segment_ids=kseg)
        k_sel, v_sel, ki_sel = _gather(k, slot), _gather(v, slot), _gather(ki, slot)
        if indexer_kl is not None and input_weight is None:
            raise ValueError("prefix-tree rows with a key layout need input_weight (the KL rows' weights)")
        unmerged_kl = indexer_kl is not None and not _kl_takes_weights(cfg, indexer_kl)
    else:
        sel = dict(rows, **tree)
        k_sel, v_sel, ki_sel = k, v, ki
    if unmerged_kl:
        # KL rows = the gathered key rows: each trajectory's inputs (all but its last entry) once
        nxt = jax.numpy.pad(kseg[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
        kl_rows = dict(q_positions=kpos, q_segment_ids=jax.numpy.where(nxt == kseg, kseg, -1), kv_positions=kpos,
                       kv_segment_ids=kseg)
        take = lambda x: _gather(x, slot)                                      # noqa: E731
        ids_kl = lambda ids: jax.vmap(lambda ib, sb: ib[:, sb])(ids, slot)      # noqa: E731
        kl_extra = {}
    else:
        kl_rows, take, ids_kl = sel, (lambda x: x), (lambda x: x)
        kl_extra = {} if input_weight is None else {"q_weights": input_weight}
    kl_sum = kl_cnt = jax.numpy.zeros((), jax.numpy.float32)
    if indexer_kl == "dense":
        o = attention(q, k, v, implementation=cfg.attention_impl, **rows, **tree)
        kl_sum, kl_cnt = msa_ops.indexer_kl(take(q), k_sel, take(qi), ki_sel, None, block_size=blk, **kl_rows,
                                            implementation=_dense_kl_impl(cfg), **kl_extra)
        return o, kl_sum, kl_cnt, None, None
    ids = msa_ops.msa_select_blocks(qi, ki_sel, block_size=blk, topk=cfg.index_topk, init_blocks=cfg.index_init_blocks,
                                    local_blocks=cfg.index_local_blocks, implementation=cfg.msa_impl, **sel)
    o, lse = msa_ops.msa_attention(q, k_sel, v_sel, ids, block_size=blk, implementation=cfg.msa_impl, **sel)
    if indexer_kl == "sparse":
        # Same implementation as the selection and attention: "auto" is the Pallas KL kernel on GPU/TPU.
        # The XLA reference scores every visible key in fp32 (O(T^2): ~475 TFLOP per step for the 1.9B
        # bench model at 64K, vs the kernel's O(T * topk * block)).
        # The attention's LSE is the teacher's normaliser over the same support: the KL kernel skips
        # recomputing it (stop_gradient: the teacher gets no gradient).
        kl_sum, kl_cnt = msa_ops.indexer_kl(take(q), k_sel, take(qi), ki_sel, ids_kl(ids), block_size=blk,
                                            implementation=cfg.msa_impl, teacher_lse=jax.lax.stop_gradient(take(lse)),
                                            **kl_rows, **kl_extra)
    return o, kl_sum, kl_cnt, ids, lse
