"""Long-prompt prefill of ``DecodeEngine``: cost follows the prompt, not ``max_len``.

Micro float32 models (``tests.train_helpers``: an M2-style dense model and an M3-style model
with an MSA layer of 8-token blocks, top-2, so prompts past 24 tokens are really sparse), page
size 8, prefill chunks of 32 tokens and ``max_len`` 4096 (512 pages per sequence):

(a) every prefill chunk receives only the power-of-two bucket of the pages its rows have filled
    (at least one chunk's pages; spy on ``model_step``), whatever ``max_len``, and its results
    equal (to float32 rounding: XLA picks dot kernels by shape) gathering the whole table, the
    previous behaviour;
(b) the returned last-position logits equal ``forward``'s for prompts spanning many chunks;
(c) the per-prompt offsets are exact when prompts of different lengths (and a prefix-cache hit)
    finish prefill at different chunks: tokens, all-position logits, trailing hidden states and
    a following decode step all match ``forward``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.decode import DecodeEngine
from minimax_jax.decode import engine as engine_mod
from minimax_jax.decode import step as step_mod
from minimax_jax.model.transformer import forward
from tests.train_helpers import MICRO_MODEL, MICRO_MSA_MODEL, random_params

PAGE, CHUNK, MAX_LEN, REF_LEN = 8, 32, 4096, 256
ATOL = 1e-4


@functools.lru_cache(maxsize=None)
def _model(kind: str):
    """Micro config and random params (numpy: ``init_params`` takes seconds on CPU)."""
    d = {k: v for k, v in (MICRO_MSA_MODEL if kind == "m3" else MICRO_MODEL).items() if k != "name"}
    cfg = ModelConfig.from_dict({**d, "dtype": "float32", "param_dtype": "float32", "num_mtp_modules": 0,
                                 "max_position_embeddings": MAX_LEN})
    return cfg, random_params(cfg)


@functools.partial(jax.jit, static_argnums=1)
def _fwd(params, cfg, tokens):
    out = forward(params, cfg, tokens, return_hidden=True)
    return out.logits, out.hidden


def _reference(cfg, params, tokens):
    """``forward`` logits and hidden states ``[len(tokens), .]`` (right-padded: causal, exact)."""
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, :len(tokens)] = tokens
    logits, hidden = _fwd(params, cfg, jnp.asarray(padded))
    return np.asarray(logits)[0, :len(tokens)], np.asarray(hidden)[0, :len(tokens)]


def _engine(cfg, params, max_len=MAX_LEN, max_seqs=3, **kw):
    return DecodeEngine(params, cfg, max_seqs=max_seqs, max_len=max_len, page_size=None if cfg.has_msa else PAGE,
                        prefill_chunk=CHUNK, implementation="xla", **kw)


def _tokens(rng, cfg, n):
    return [int(t) for t in rng.integers(3, cfg.vocab_size, n)]


class _Spy:
    """Records ``(page-table width, longest filled length)`` of every gather step."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = engine_mod.model_step

        def spy(params, cache, tokens, positions, page_table, *a, **kw):
            if kw["path"] == "gather":
                self.calls.append((page_table.shape[1], int(np.asarray(positions).max()) + 1))
            return real(params, cache, tokens, positions, page_table, *a, **kw)

        monkeypatch.setattr(engine_mod, "model_step", spy)


class _FullTableEngine(DecodeEngine):
    """The previous behaviour: every prefill chunk gathers the whole page table."""

    def prefill_table_width(self, num_tokens):
        return self.spec.pages_per_seq


def test_prefill_gathers_only_filled_pages(monkeypatch):
    cfg, params = _model("m3")
    rng = np.random.default_rng(0)
    prompts = [_tokens(rng, cfg, n) for n in (150, 41)]
    spy = _Spy(monkeypatch)
    eng = _engine(cfg, params)
    assert eng.spec.pages_per_seq == 512
    _, lg = eng.prefill(prompts)
    assert len(spy.calls) == math.ceil(150 / CHUNK)
    for width, filled in spy.calls:
        need = math.ceil(max(filled, CHUNK) / PAGE)
        assert need <= width < 2 * need and width & (width - 1) == 0  # power-of-two bucket of the filled pages
    assert [w for w, _ in spy.calls] == [4, 8, 16, 16, 32]
    small = _engine(cfg, params, max_len=256)                         # the widths do not depend on max_len
    assert all(small.prefill_table_width(n) == eng.prefill_table_width(n) for n in range(1, 257))
    full = _FullTableEngine(params, cfg, max_seqs=3, max_len=MAX_LEN, prefill_chunk=CHUNK, implementation="xla")
    _, lg_full = full.prefill(prompts)
    for a, b in zip(lg, lg_full):                                     # the old path, to fp32 rounding
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_compile_prefill_covers_the_widths_a_prompt_uses(monkeypatch):
    cfg, params = _model("m2")
    eng = _engine(cfg, params)
    spy = _Spy(monkeypatch)
    assert eng.compile_prefill(100) == [4, 8, 16]
    assert all(x is None for x in eng.seqs) and eng.pool.num_free == eng.spec.num_pages - 1
    spy.calls = []
    compiled = step_mod.model_step._cache_size()          # jit cache entries (the caches are committed
    eng.prefill([_tokens(np.random.default_rng(1), cfg, 100)])   # at creation: no second compile per shape)
    assert step_mod.model_step._cache_size() == compiled
    assert {w for w, _ in spy.calls} == {4, 8, 16}
    assert eng.prefill_table_width(MAX_LEN) == 512 and eng.prefill_table_width(1) == CHUNK // PAGE
    with pytest.raises(ValueError, match="num_tokens"):
        eng.prefill_table_width(MAX_LEN + 1)


@pytest.mark.parametrize("kind", ["m2", "m3"])
def test_last_logits_match_forward_over_many_chunks(kind):
    cfg, params = _model(kind)
    rng = np.random.default_rng(2)
    prompts = [_tokens(rng, cfg, n) for n in (200, 77, 9)]
    slots, logits = _engine(cfg, params).prefill(prompts)
    for p, lg in zip(prompts, logits):
        assert lg.shape == (1, cfg.vocab_size)
        np.testing.assert_allclose(lg[0], _reference(cfg, params, p)[0][-1], atol=ATOL, rtol=0)


def test_offsets_exact_when_prompts_finish_at_different_chunks():
    cfg, params = _model("m3")
    rng = np.random.default_rng(4)
    eng = _engine(cfg, params)
    eng.pool.shuffle(5)
    base = _tokens(rng, cfg, 60)
    (b,), _ = eng.prefill([base])                                     # publishes 7 full pages
    eng.free(b)                                                       # which stay cached
    prompts = [_tokens(rng, cfg, 5), base[:59] + _tokens(rng, cfg, 90), _tokens(rng, cfg, 230)]
    slots, logits, hidden = eng.prefill(prompts, return_hidden=True, return_all_logits=True, hidden_last=40)
    cached = [eng.seqs[s].cached_tokens for s in slots]
    assert cached == [0, 56, 0]                     # 5, 93, 230 tokens computed: done after chunk 1, 3, 8
    for s, p, c, lg, h in zip(slots, prompts, cached, logits, hidden):
        assert eng.seqs[s].tokens == p and eng.length(s) == len(p)
        ref_l, ref_h = _reference(cfg, params, p)
        assert lg.shape == (len(p) - c, cfg.vocab_size)
        np.testing.assert_allclose(lg, ref_l[c:], atol=ATOL, rtol=0)
        m = min(40, len(p) - c)                                       # spans two chunks
        assert h.shape == (m, cfg.hidden_size)
        np.testing.assert_allclose(h, ref_h[len(p) - m:], atol=ATOL, rtol=0)
    nxt = [_tokens(rng, cfg, 2) for _ in prompts]                     # the cache holds exactly the prompts
    out = eng.decode_step(np.array(nxt), slots)
    for p, x, o in zip(prompts, nxt, out):
        np.testing.assert_allclose(o, _reference(cfg, params, p + x)[0][len(p):], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="hidden_last"):
        eng.prefill([base], return_hidden=True, hidden_last=0)
