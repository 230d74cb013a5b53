"""DecodeEngine end to end on an MSA model: paged prefill + decode logits equal ``forward``.

2-layer float32 model (dense layer + MSA layer with block 16, top-4: contexts past 64 tokens are
really sparse), a batch of three sequences of different lengths, lengths crossing page
boundaries, Q in {1, 2, 8, 16} rows per step, shuffled (non-contiguous) page tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from minimax_jax.decode import DecodeEngine
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from tests.decode.test_decode_fixtures import assert_close, random_tokens, reference_logits, small_model


def _engine(params, cfg, **kw):
    return DecodeEngine(params, cfg, max_seqs=3, max_len=176, prefill_chunk=32, implementation="xla",
                        query_rows=16, **kw)


@pytest.mark.parametrize("q", [1, 2, 8, 16])
def test_batched_prefill_and_decode_match_forward(q):
    cfg, params = small_model("m3")
    rng = np.random.default_rng(0)
    eng = _engine(params, cfg)
    eng.pool.shuffle(int(rng.integers(1 << 30)))
    prompts = [random_tokens(rng, cfg, n) for n in (70, 37, 100)]
    full = [p + random_tokens(rng, cfg, 40) for p in prompts]
    refs = [reference_logits(cfg, params, f) for f in full]
    slots, logits = eng.prefill(prompts, return_all_logits=True)
    for s, p, lg, ref in zip(slots, prompts, logits, refs):
        assert_close(lg, ref[: len(p)])
    tables = eng.tables[slots]
    assert not all(np.all(np.diff(t[t > 0]) == 1) for t in tables)    # really non-contiguous
    lens = [len(p) for p in prompts]
    for _ in range(2 if q < 16 else 1):
        lg = eng.decode_step(np.array([f[n:n + q] for f, n in zip(full, lens)]), slots)
        assert lg.shape == (3, q, cfg.vocab_size)
        for i, n in enumerate(lens):
            assert_close(lg[i], refs[i][n:n + q])
        lens = [n + q for n in lens]


def test_exact_q_without_padding_and_sparsity_bites():
    cfg, params = small_model("m3")
    rng = np.random.default_rng(1)
    eng = DecodeEngine(params, cfg, max_seqs=1, max_len=176, prefill_chunk=32, implementation="xla")
    seq = random_tokens(rng, cfg, 99)
    ref = reference_logits(cfg, params, seq)
    (s,), (lg,) = eng.prefill([seq[:97]], return_all_logits=True)
    assert_close(lg, ref[:97])
    clear_implementation_report()                          # a fresh trace (new engine shapes) records
    assert_close(eng.decode_step(np.array([seq[97:]]), [s])[0], ref[97:])
    rep = implementation_report()
    assert rep["paged_attention"] == "xla" and rep["msa_decode_select"] == "xla"
    dense_cfg = cfg.replace(layer_types=("full", "full"))
    dense = reference_logits(dense_cfg, params, seq)
    assert_close(dense[:64], ref[:64])                     # <= K*B tokens: MSA == dense
    assert np.abs(dense[70:] - ref[70:]).max() > 1e-2      # beyond: the selection matters


def test_bad_arguments_raise():
    cfg, params = small_model("m3")
    with pytest.raises(ValueError, match="page_size == index_block_size"):
        DecodeEngine(params, cfg, max_seqs=1, max_len=64, page_size=8)
    with pytest.raises(ValueError, match="query_rows"):
        DecodeEngine(params, cfg, max_seqs=1, max_len=64, query_rows=17)
    eng = _engine(params, cfg)
    with pytest.raises(ValueError, match="holds no sequence"):
        eng.decode_step(np.array([[4]]), [0])
    with pytest.raises(ValueError, match="prompt length"):
        eng.prefill([[]])
