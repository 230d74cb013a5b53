"""Long-context decoding: paged KV / index-key caches, prefix caching, chunked prefill, decode steps.

Modules (one job each): ``pages`` (host page pool + prefix cache), ``cache`` (device cache layout,
fp8 quantisation, writes/gathers), ``step`` (one jit-compiled model step over the caches),
``engine`` (``DecodeEngine``: slots, page tables, prefill/decode API). The paged decode ops
(attention, MSA page selection) are ``minimax_jax.ops.paged``, re-exported here.
"""

from minimax_jax.decode.cache import CacheSpec, init_cache
from minimax_jax.decode.engine import DecodeEngine
from minimax_jax.decode.pages import PagePool, PagePoolExhausted, chain_hashes
from minimax_jax.decode.step import model_step
from minimax_jax.ops.paged import msa_decode, msa_decode_select, paged_attention

__all__ = ["CacheSpec", "init_cache", "DecodeEngine", "msa_decode", "msa_decode_select", "paged_attention",
           "PagePool", "PagePoolExhausted", "chain_hashes", "model_step"]
