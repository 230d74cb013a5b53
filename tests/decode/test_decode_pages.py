"""Host page pool of the decode engine: allocation, exhaustion, prefix cache, LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest

from minimax_jax.decode.pages import NULL_PAGE, PagePool, PagePoolExhausted, chain_hashes


def test_allocate_release_and_exhaustion():
    pool = PagePool(5)                                   # 4 usable pages
    got = pool.allocate(3)
    assert len(set(got)) == 3 and NULL_PAGE not in got
    with pytest.raises(PagePoolExhausted, match="2 page\\(s\\) requested, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1                            # nothing taken by the failed call
    pool.release(got[:2])
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        pool.release([got[0]])
    with pytest.raises(ValueError):
        PagePool(1)


def test_chain_hashes_depend_on_whole_prefix():
    rng = np.random.default_rng(0)
    a = list(rng.integers(0, 1000, 40))
    b = list(a)
    b[3] += 1                                            # differs in page 0 only
    ha, hb = chain_hashes(a, 8), chain_hashes(b, 8)
    assert len(ha) == 5 and len(chain_hashes(a[:39], 8)) == 4
    assert all(x != y for x, y in zip(ha, hb))           # every later page differs too
    c = a[:16] + [t + 1 for t in a[16:]]
    hc = chain_hashes(c, 8)
    assert hc[:2] == ha[:2] and hc[2] != ha[2]


def test_prefix_lookup_refcounts_and_lru_eviction():
    pool = PagePool(4)                                   # pages 1..3
    hs = chain_hashes(list(range(24)), 8)
    pages = pool.allocate(3)
    for p, h in zip(pages, hs):
        assert pool.register(p, h) == p
    assert pool.lookup(hs) == pages                      # second user
    assert [pool.refcount(p) for p in pages] == [2, 2, 2]
    pool.release(pages)
    pool.release(pages)                                  # all unreferenced, still cached
    assert pool.num_cached == 3 and pool.num_free == 3
    assert pool.lookup(hs[:1]) == pages[:1]              # page 0 becomes most recently used
    pool.release(pages[:1])
    new = pool.allocate(1)                               # evicts the LRU page: pages[1]
    assert new == [pages[1]]
    assert pool.lookup(hs) == pages[:1]                  # chain broken at page 1
    assert pool.num_cached == 2


def test_register_duplicate_content_keeps_first():
    pool = PagePool(4)
    h = chain_hashes(list(range(8)), 8)[0]
    a, b = pool.allocate(2)
    assert pool.register(a, h) == a
    assert pool.register(b, h) == a                      # b stays private
    pool.release([b])
    assert pool.num_free == 2 and pool.num_cached == 1   # b went straight back to the free list


def test_chain_hashes_continue_from_a_digest():
    toks = list(np.random.default_rng(1).integers(0, 500, 48))
    full = chain_hashes(toks, 8)
    assert chain_hashes(toks[16:], 8, full[1]) == full[2:]
