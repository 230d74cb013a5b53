"""DecodeEngine end to end: paged prefill + decode logits equal the full-sequence forward pass.

float32 tiny configs (tiny-m3: block 16, top-4, so contexts past 64 tokens are really sparse;
tiny-m2: dense), lengths crossing page boundaries, batches of different lengths, Q in
{1, 2, 8, 16} rows per step, shuffled (non-contiguous) page tables, prefix-cache hits,
speculative rollback, pool exhaustion.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.decode import DecodeEngine, PagePoolExhausted
from minimax_jax.model.params import init_params
from minimax_jax.model.transformer import forward
from minimax_jax.ops.common import clear_implementation_report, implementation_report

ATOL = 1e-4


@functools.lru_cache(maxsize=None)
def _model(name):
    cfg = ModelConfig.from_yaml(f"configs/{name}.yaml")
    return cfg, init_params(cfg, jax.random.PRNGKey(7))


def _ref(cfg, params, tokens):
    return np.asarray(forward(params, cfg, jnp.asarray(np.asarray(tokens)[None], jnp.int32)).logits[0])


def _tokens(rng, cfg, n):
    return [int(t) for t in rng.integers(3, cfg.vocab_size, n)]


def _check(got, want):
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("q", [1, 2, 8, 16])
def test_m3_batched_prefill_and_decode_match_forward(q):
    cfg, params = _model("tiny-m3")
    rng = np.random.default_rng()
    eng = DecodeEngine(params, cfg, max_seqs=3, max_len=160, prefill_chunk=32, implementation="xla")
    eng.pool.shuffle(int(rng.integers(1 << 30)))
    prompts = [_tokens(rng, cfg, n) for n in (70, 37, 100)]
    slots, logits = eng.prefill(prompts)
    full = [p + _tokens(rng, cfg, 40) for p in prompts]
    for s, p, lg, f in zip(slots, prompts, logits, full):
        _check(lg, _ref(cfg, params, f)[: len(p)])
        assert eng.seqs[s].cached_tokens == 0
    tables = eng.tables[slots]
    assert not all(np.all(np.diff(t[t > 0]) == 1) for t in tables)    # pages really shuffled
    outs = [[] for _ in slots]
    lens = [len(p) for p in prompts]
    for _ in range(2 if q < 16 else 1):
        step = np.array([f[n:n + q] for f, n in zip(full, lens)])
        lg = eng.decode_step(step, slots)
        for i in range(len(slots)):
            outs[i].append(lg[i])
        lens = [n + q for n in lens]
    for i, (f, p) in enumerate(zip(full, prompts)):
        got = np.concatenate(outs[i])
        _check(got, _ref(cfg, params, f)[len(p): len(p) + len(got)])


def test_m3_sparsity_bites_at_these_lengths():
    """The MSA model differs from the same weights run densely past K*B = 64 tokens."""
    cfg, params = _model("tiny-m3")
    toks = _tokens(np.random.default_rng(), cfg, 120)
    dense_cfg = cfg.replace(layer_types=tuple("full" if t == "msa" else t for t in cfg.layer_types))
    a, b = _ref(cfg, params, toks), _ref(dense_cfg, params, toks)
    np.testing.assert_allclose(a[:64], b[:64], atol=ATOL)
    assert np.abs(a[70:] - b[70:]).max() > 1e-2


def test_prefix_cache_hits_match_forward():
    cfg, params = _model("tiny-m3")
    rng = np.random.default_rng()
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=128, prefill_chunk=24, implementation="xla")
    a = _tokens(rng, cfg, 83)
    (sa,), (la,) = eng.prefill([a])
    _check(la, _ref(cfg, params, a))
    b = a[:55] + _tokens(rng, cfg, 30)                     # shares 3 full pages (48 tokens)
    (sb,), (lb,) = eng.prefill([b])
    assert eng.seqs[sb].cached_tokens == 48
    assert eng.seqs[sb].pages[:3] == eng.seqs[sa].pages[:3]
    ref_b = _ref(cfg, params, b + [5, 6])
    _check(lb, ref_b[48:len(b)])
    _check(eng.decode_step(np.array([[5, 6]]), [sb])[0], ref_b[len(b):])
    eng.free(sa)
    eng.free(sb)
    (sc,), (lc,) = eng.prefill([a + [9]])                   # unreferenced pages are still cached
    assert eng.seqs[sc].cached_tokens == 80
    _check(lc, _ref(cfg, params, a + [9])[80:])


def test_whole_prompt_cached_still_returns_last_logits():
    cfg, params = _model("tiny-m3")
    rng = np.random.default_rng()
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=64, prefill_chunk=16, implementation="xla")
    a = _tokens(rng, cfg, 32)
    eng.prefill([a])
    (s,), (lg,) = eng.prefill([a])
    assert eng.seqs[s].cached_tokens == 16 and lg.shape[0] == 16
    _check(lg, _ref(cfg, params, a)[16:])


def test_speculative_rollback_with_copy_on_write():
    cfg, params = _model("tiny-m3")
    rng = np.random.default_rng()
    eng = DecodeEngine(params, cfg, max_seqs=1, max_len=128, prefill_chunk=32, implementation="xla")
    seq = _tokens(rng, cfg, 76)
    (s,), _ = eng.prefill([seq])
    drafts = _tokens(rng, cfg, 4)                          # 76 + 4 = 80: page 4 becomes full
    eng.decode_step(np.array([drafts]), [s])
    assert eng.pool.num_cached == 5
    old_page = eng.seqs[s].pages[4]
    eng.truncate(s, 78)                                    # keep 2 drafts; page 4 is published -> copied
    assert eng.seqs[s].pages[4] != old_page
    seq = seq + drafts[:2]
    nxt = _tokens(rng, cfg, 3)
    got = eng.decode_step(np.array([nxt]), [s])[0]
    _check(got, _ref(cfg, params, seq + nxt)[78:])


def test_m2_dense_paged_decode_and_padding_rows():
    cfg, params = _model("tiny-m2")
    rng = np.random.default_rng()
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=100, page_size=16, prefill_chunk=20, implementation="xla")
    eng.pool.shuffle(3)
    p = [_tokens(rng, cfg, 33), _tokens(rng, cfg, 18)]
    slots, lg = eng.prefill(p)
    nxt = [_tokens(rng, cfg, 3), _tokens(rng, cfg, 3)]
    out = eng.decode_step(np.array(nxt), slots, num_tokens=[3, 1])  # second row: one real token
    for i, n in enumerate((3, 1)):
        ref = _ref(cfg, params, p[i] + nxt[i][:n])
        _check(lg[i], ref[: len(p[i])])
        _check(out[i, :n], ref[len(p[i]):])
    assert eng.length(slots[1]) == 19


def test_pool_exhausted_is_clear_and_leaves_state_intact():
    cfg, params = _model("tiny-m2")
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=64, page_size=16, num_pages=4, prefill_chunk=16,
                       implementation="xla")
    (s,), _ = eng.prefill([list(range(3, 40))])            # 3 pages: the pool is full
    with pytest.raises(PagePoolExhausted, match="page pool exhausted"):
        eng.prefill([list(range(3, 20))])
    assert sum(x is not None for x in eng.seqs) == 1
    with pytest.raises(PagePoolExhausted):
        eng.decode_step(np.array([[5] * 12]), [s])         # 37 + 12 needs a 4th page
    assert eng.length(s) == 37 and len(eng.seqs[s].pages) == 3
    eng.free(s)
    assert eng.pool.num_free == 3


def test_implementation_is_recorded_and_bad_sizes_raise():
    cfg, params = _model("tiny-m3")
    with pytest.raises(ValueError, match="page_size == index_block_size"):
        DecodeEngine(params, cfg, max_seqs=1, max_len=64, page_size=8)
    eng = DecodeEngine(params, cfg, max_seqs=1, max_len=40, prefill_chunk=16, implementation="xla")
    (s,), _ = eng.prefill([list(range(3, 20))])
    clear_implementation_report()
    eng.decode_step(np.array([[4]]), [s])
    rep = implementation_report()
    assert rep["paged_attention"] == "xla" and rep["msa_decode_select"] == "xla"
    with pytest.raises(ValueError, match="exceeds max_len"):
        eng.decode_step(np.array([[4] * 16, ]), [s])
        eng.decode_step(np.array([[4] * 16, ]), [s])
