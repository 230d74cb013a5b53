"""Long-context decoding: paged KV / index-key caches, prefix caching, chunked prefill, decode steps.

Modules (one job each): ``pages`` (host page pool + prefix cache), ``cache`` (device cache layout,
fp8 quantisation, writes/gathers), ``ops`` (paged decode attention and MSA page selection with an
``implementation=`` choice; Pallas kernels in ``pallas_kernels.decode``), ``step`` (one jit-compiled
model step over the caches), ``engine`` (``DecodeEngine``: slots, page tables, prefill/decode API).
"""

from minimax_jax.decode.cache import CacheSpec, init_cache
from minimax_jax.decode.engine import DecodeEngine
from minimax_jax.decode.ops import msa_decode, msa_decode_select, paged_attention
from minimax_jax.decode.pages import PagePool, PagePoolExhausted, chain_hashes
from minimax_jax.decode.step import model_step

__all__ = ["CacheSpec", "init_cache", "DecodeEngine", "msa_decode", "msa_decode_select", "paged_attention",
           "PagePool", "PagePoolExhausted", "chain_hashes", "model_step"]
