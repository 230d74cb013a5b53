"""Host-side page pool: allocation, freeing, reference counts and a prefix cache.

A page holds ``page_size`` consecutive tokens of one sequence (for MSA models a page is one MSA
block, MSA_SPEC.md section 5) in every layer's K/V cache and, for MSA layers, the index-key cache:
all of them use the same page id, so sharing a page shares all of its caches.

Page 0 is reserved as a scratch ("null") page: padded page-table entries point at it and writes of
padding tokens land in it; it is never handed out.

Prefix caching: a FULL page is identified by a chain hash ``h_i = H(h_{i-1}, tokens of page i)``
(``h_{-1}`` = a fixed seed), so equal hashes mean equal token content of the whole prefix, which is
what the causal K/V (and index keys) of the page depend on. Registered pages are reference counted;
when a page's count drops to 0 it stays cached (evictable) and is evicted least recently used when
the free list runs dry. Unregistered pages go straight back to the free list.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterable, Sequence

import numpy as np

__all__ = ["PagePoolExhausted", "PagePool", "chain_hashes", "NULL_PAGE"]

NULL_PAGE = 0
_SEED = b"minimax-jax/decode/prefix/v1"


class PagePoolExhausted(RuntimeError):
    """Raised when a page is requested but every page is in use by a live sequence."""


def chain_hashes(tokens: Sequence[int], page_size: int, prev: bytes | None = None) -> list[bytes]:
    """Chain hashes of the full pages of ``tokens`` (a partial last page gets none).

    Args:
      tokens: token ids (ints).
      page_size: tokens per page (> 0).
      prev: digest of the page before ``tokens[0]`` when continuing a chain (None = start).
    Returns: ``len(tokens) // page_size`` digests (16 bytes each, BLAKE2b); digest ``i`` depends on
      all tokens ``[0, (i + 1) * page_size)`` (and on the pages behind ``prev``).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    arr = np.asarray(list(tokens), dtype=np.int64)
    out, prev = [], (_SEED if prev is None else prev)
    for i in range(len(arr) // page_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(arr[i * page_size:(i + 1) * page_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class PagePool:
    """Allocator over page ids ``1 .. num_pages - 1`` (page 0 is the null page).

    Args:
      num_pages: total pages in the device cache arrays, including the null page (>= 2).
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = int(num_pages)
        self._free: collections.deque[int] = collections.deque(range(1, self.num_pages))
        self._ref = np.zeros(self.num_pages, np.int64)
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # ref==0 cached pages

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Pages obtainable now: the free list plus evictable cached pages."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (live or evictable)."""
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return int(self._ref[page])

    def shuffle(self, seed: int) -> None:
        """Permute the free list (tests use it to get non-contiguous, out-of-order page tables)."""
        order = list(self._free)
        np.random.default_rng(seed).shuffle(order)
        self._free = collections.deque(order)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` pages (reference count 1 each), evicting LRU cached pages when needed.

        Raises: PagePoolExhausted (nothing is taken) when fewer than ``n`` pages are obtainable.
        """
        if n > self.num_free:
            raise PagePoolExhausted(
                f"page pool exhausted: {n} page(s) requested, {len(self._free)} free + {len(self._lru)} "
                f"evictable of {self.num_pages - 1} usable; free sequences or build the engine with more "
                f"num_pages")
        out = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p, _ = self._lru.popitem(last=False)   # least recently used
                del self._page_of[self._hash_of.pop(p)]
            self._ref[p] = 1
            out.append(p)
        return out

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; unreferenced pages become free or evictable."""
        for p in pages:
            p = int(p)
            if p == NULL_PAGE or self._ref[p] <= 0:
                raise ValueError(f"release of page {p} which is not allocated")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._hash_of:
                    self._lru[p] = None            # most recently used end
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest cached prefix: pages for ``hashes[0..n)``, each with one more reference."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        for p in pages:
            if self._ref[p] == 0:
                self._lru.pop(p)
            self._ref[p] += 1
        return pages

    def register(self, page: int, digest: bytes) -> int:
        """Publish a full, written ``page`` under ``digest``.

        Returns the page id that now holds the digest: ``page`` itself, or an already registered
        page with the same content (the caller may keep using its own copy; it stays private).
        """
        if self._ref[page] <= 0:
            raise ValueError(f"register of page {page} which is not allocated")
        have = self._page_of.get(digest)
        if have is not None:
            return have
        if page in self._hash_of:
            return page
        self._page_of[digest] = page
        self._hash_of[page] = digest
        return page
