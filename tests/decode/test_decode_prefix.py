"""DecodeEngine prefix caching and speculative rollback on an MSA model (logits equal ``forward``).

A cached prefix keeps its K/V AND index-key pages (same page ids), so prefill over it is the
"queries are a suffix of keys" case; a truncated sequence copies a published partial page first.
"""

from __future__ import annotations

import numpy as np

from minimax_jax.decode import DecodeEngine
from tests.decode.test_decode_fixtures import assert_close, random_tokens, reference_logits, small_model


def _engine(params, cfg):
    # Same static shapes as tests/decode/test_decode_engine.py, so compiled steps are shared in one process.
    return DecodeEngine(params, cfg, max_seqs=3, max_len=176, prefill_chunk=32, implementation="xla",
                        query_rows=16)


def test_prefix_cache_hits_match_forward():
    cfg, params = small_model("m3")
    rng = np.random.default_rng(0)
    eng = _engine(params, cfg)
    a = random_tokens(rng, cfg, 83)
    (sa,), (la,) = eng.prefill([a], return_all_logits=True)
    assert_close(la, reference_logits(cfg, params, a))
    b = a[:55] + random_tokens(rng, cfg, 45)               # shares 3 full pages (48 tokens) with a
    (sb,), (lb,) = eng.prefill([b], return_all_logits=True)
    assert eng.seqs[sb].cached_tokens == 48
    assert eng.seqs[sb].pages[:3] == eng.seqs[sa].pages[:3]
    ref_b = reference_logits(cfg, params, b + [5, 6])
    assert_close(lb, ref_b[48:len(b)])                     # 100 tokens: past K*B, sparse selection
    assert_close(eng.decode_step(np.array([[5, 6]]), [sb])[0], ref_b[len(b):])
    eng.free(sa)
    eng.free(sb)
    (sc,), (lc,) = eng.prefill([a + [9]], return_all_logits=True)  # unreferenced pages stay cached (LRU)
    assert eng.seqs[sc].cached_tokens == 80
    assert_close(lc, reference_logits(cfg, params, a + [9])[80:])


def test_whole_prompt_cached_still_returns_last_logits():
    cfg, params = small_model("m3")
    rng = np.random.default_rng(1)
    eng = _engine(params, cfg)
    a = random_tokens(rng, cfg, 32)
    eng.prefill([a])
    (s,), (lg,) = eng.prefill([a], return_all_logits=True)  # keeps >= 1 token to compute
    assert eng.seqs[s].cached_tokens == 16 and lg.shape[0] == 16
    assert_close(lg, reference_logits(cfg, params, a)[16:])


def test_speculative_rollback_with_copy_on_write():
    cfg, params = small_model("m3")
    rng = np.random.default_rng(2)
    eng = _engine(params, cfg)
    seq = random_tokens(rng, cfg, 76)
    (s,), _ = eng.prefill([seq])
    drafts = random_tokens(rng, cfg, 4)                    # 76 + 4 = 80 tokens: page 4 becomes full
    eng.decode_step(np.array([drafts]), [s])
    assert eng.pool.num_cached == 5
    old_page = eng.seqs[s].pages[4]
    eng.truncate(s, 78)                                    # accept 2 drafts; page 4 is published
    assert eng.seqs[s].pages[4] != old_page and eng.length(s) == 78
    seq = seq + drafts[:2]
    nxt = random_tokens(rng, cfg, 3)
    assert_close(eng.decode_step(np.array([nxt]), [s])[0], reference_logits(cfg, params, seq + nxt)[78:])
    # the published page still serves others
    (t,), (lt,) = eng.prefill([seq[:76] + drafts + [7]], return_all_logits=True)
    assert eng.seqs[t].cached_tokens == 80
    assert_close(lt, reference_logits(cfg, params, seq[:76] + drafts + [7])[80:])
