"""MiniMax Sparse Attention (MSA) ops: index scores, block selection, block-sparse attention, indexer KL.

MSA (arXiv 2606.13392, "MiniMax Sparse Attention"; the attention of MiniMax-M3; the contract is
``/work/shared/docs/MSA_SPEC.md``) replaces dense causal attention by block-sparse attention whose
blocks are chosen per query token and per GQA group by a light index branch:

1. Index scores (spec section 1): ``s[r, i, j] = <qi[i, r], ki[j]> / sqrt(Di)`` for keys ``j``
   visible to query ``i`` (one index-query head per kv group ``r``, one shared index-key head).
   The block score is the max of ``s`` over the visible keys of each block of ``B`` tokens; a key's
   block is ``kv_pos // B`` (per document when sequences are packed).
2. Selection (spec section 2): the local block ``local = q_pos // B`` is always kept; the other
   ``K - 1`` slots take the highest-scoring blocks among ``[0, local)`` (ties to the lower id);
   ``valid = min(K, local + 1)``, ``-1`` pads. Contexts of at most ``K * B`` tokens therefore
   attend to everything: MSA equals dense causal attention there.
3. Main branch (spec section 3): head ``h`` of group ``r = h // (H / G)`` attends the union of the
   group's selected blocks, causally inside the local block, exact fp32 softmax; outputs ``o`` and
   the natural-log ``lse``.
4. Indexer training (spec section 4): ``KL(teacher || student)`` on the selected support, teacher =
   group-mean of the main-branch probabilities renormalised on the support (stop_gradient),
   student = softmax of the index scores on the support; a dense variant over the whole causal
   history warms the indexer up. Only the index projections receive its gradient.

Modules: ``api`` (the public functions, their validation and registry entries), ``pallas`` (the
kernel implementations and when they apply), ``reference`` (chunked index scores / selection /
attention, memory O(chunk * S)), ``kl`` (chunked indexer KL), ``common`` (visibility, block ids,
query chunking, safe masked softmax).
"""

from minimax_jax.ops.msa.api import (DEFAULT_CHUNK_SIZE, IMPLEMENTATIONS, indexer_kl, msa_attention,
                                     msa_index_scores, msa_select_blocks)

__all__ = ["msa_index_scores", "msa_select_blocks", "msa_attention", "indexer_kl", "DEFAULT_CHUNK_SIZE",
           "IMPLEMENTATIONS"]
