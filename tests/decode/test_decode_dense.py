"""DecodeEngine on a dense-attention (M2-style) model: paged decode, padding rows, pool exhaustion."""

from __future__ import annotations

import numpy as np
import pytest

from minimax_jax.decode import DecodeEngine, PagePoolExhausted
from tests.decode.test_decode_fixtures import assert_close, random_tokens, reference_logits, small_model


def test_dense_paged_decode_and_padding_rows():
    cfg, params = small_model("m2")
    rng = np.random.default_rng(0)
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=100, page_size=16, prefill_chunk=20, implementation="xla")
    eng.pool.shuffle(int(rng.integers(1 << 30)))
    p = [random_tokens(rng, cfg, 33), random_tokens(rng, cfg, 18)]
    nxt = [random_tokens(rng, cfg, 3), random_tokens(rng, cfg, 3)]
    slots, lg = eng.prefill(p, return_all_logits=True)
    out = eng.decode_step(np.array(nxt), slots, num_tokens=[3, 1])  # second row: one real token
    for i, n in enumerate((3, 1)):
        ref = reference_logits(cfg, params, p[i] + nxt[i][:n])
        assert_close(lg[i], ref[: len(p[i])])
        assert_close(out[i, :n], ref[len(p[i]):])
    assert eng.length(slots[1]) == 19


def test_pool_exhausted_is_clear_and_leaves_state_intact():
    cfg, params = small_model("m2")
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=100, page_size=16, num_pages=4, prefill_chunk=20,
                       implementation="xla")
    with pytest.raises(PagePoolExhausted, match="page pool exhausted"):
        eng.prefill([list(range(3, 40)), list(range(3, 20))])   # 3 + 2 pages > 3 usable
    assert all(x is None for x in eng.seqs) and eng.pool.num_free == 3
    (s,), _ = eng.prefill([list(range(3, 40))])                 # 37 tokens: exactly 3 pages
    with pytest.raises(PagePoolExhausted):
        eng.decode_step(np.array([[5] * 12]), [s])              # 37 + 12 needs a 4th page
    assert eng.length(s) == 37 and len(eng.seqs[s].pages) == 3
    with pytest.raises(ValueError, match="max_len"):
        eng.prefill([list(range(3, 200))])
    eng.free(s)
    assert eng.pool.num_free == 3


def test_hidden_states_for_mtp_match_forward():
    import jax.numpy as jnp

    from minimax_jax.model.transformer import forward

    cfg, params = small_model("m2")
    rng = np.random.default_rng(1)
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=100, page_size=16, prefill_chunk=20, implementation="xla")
    seq = random_tokens(rng, cfg, 30)
    (s,), (lg,), (hid,) = eng.prefill([seq[:28]], return_hidden=True)
    lg2, hid2 = eng.decode_step(np.array([seq[28:]]), [s], return_hidden=True)
    ref = forward(params, cfg, jnp.asarray([seq], jnp.int32), return_hidden=True)
    want = np.asarray(ref.hidden[0])
    assert hid.shape == (28, cfg.hidden_size) and hid2.shape == (1, 2, cfg.hidden_size)
    assert_close(hid, want[:28])
    assert_close(hid2[0], want[28:])
    assert_close(lg2[0], np.asarray(ref.logits[0])[28:])
