"""Indexer recall measurement."""

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import load_config
from minimax_jax.eval.recall import dense_block_mass, indexer_recall
from minimax_jax.model import init_params


def test_dense_block_mass_is_a_distribution_over_visible_blocks():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(40, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(40, 2, 8)), jnp.float32)
    m = np.asarray(dense_block_mass(q, k, 8, query_chunk=16))
    assert m.shape == (2, 40, 5)
    np.testing.assert_allclose(m.sum(-1), 1.0, rtol=1e-5)
    for t in range(40):
        assert np.all(m[:, t, t // 8 + 1:] == 0)  # causal: no mass on future blocks


def test_recall_bounds_and_perfect_when_selection_is_dense():
    cfg = load_config("tiny-m3").replace(index_block_size=8, index_topk=3, num_mtp_modules=0)
    params = init_params(cfg, jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (64,), 0, cfg.vocab_size))
    r = indexer_recall(params, cfg, tokens)
    assert set(r["layers"]) == {i for i, t in enumerate(cfg.layer_types) if t == "msa"}
    assert 0.0 < r["mean"] <= 1.0 and r["pairs"] == (64 - 24) * cfg.num_kv_heads * 3
    wide = cfg.replace(index_topk=8)   # K * B = 64 >= T: nothing is dropped, recall is trivially 1
    assert indexer_recall(params, wide, tokens)["mean"] == 1.0
