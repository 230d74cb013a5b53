"""Indexer recall measurement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    wide = cfg.replace(index_topk=8)   # K * B = 64 >= T: nothing is dropped, nothing to measure
    with pytest.raises(ValueError, match="64 tokens measure nothing: with index_topk x index_block_size = 8 x 8 = 64"):
        indexer_recall(params, wide, tokens)


def test_covered_mass_is_bounded_by_the_oracle_and_equals_it_at_full_recall():
    """``mass``: the dense attention share inside the selection; ``oracle_mass``: the most K blocks with the local one
    can hold. mass <= oracle_mass <= 1, equal where recall is 1 (the same blocks); the oracle's mass of layer 0 (its
    input is the embedding) recounted by brute force."""
    from minimax_jax.model.layers import rms_norm, rope_frequencies
    from minimax_jax.model.params import unstack_layers
    from minimax_jax.model.transformer import embed, project_qkv

    base = load_config("tiny-m3")
    cfg = base.replace(index_block_size=8, index_topk=3, num_mtp_modules=0, layer_types=("msa",) * base.num_layers)
    params = init_params(cfg, jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (64,), 0, cfg.vocab_size))
    r = indexer_recall(params, cfg, tokens)
    assert set(r["mass"]["layers"]) == set(r["oracle_mass"]["layers"]) == set(r["layers"]) == set(range(cfg.num_layers))
    for i in r["layers"]:
        got, best = r["mass"]["layers"][i], r["oracle_mass"]["layers"][i]
        assert 0.0 < got <= best + 1e-6 <= 1.0 + 1e-6
        if r["layers"][i] == 1.0:
            assert abs(got - best) < 1e-6
    assert r["mass"]["mean"] <= r["oracle_mass"]["mean"] + 1e-6
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    cos, sin = rope_frequencies(pos, cfg.rotary_dim, cfg.rope_theta)
    lp = unstack_layers(params, cfg)[0]
    h = rms_norm(embed(params, cfg, jnp.asarray(tokens)[None]), lp["input_norm"]["scale"], eps=cfg.rms_norm_eps,
                 kind=cfg.norm_kind)
    q, k, _ = project_qkv(lp, h, cfg, cos, sin)
    m = np.asarray(dense_block_mass(q[0], k[0], 8))
    want = np.mean([np.sort(m[g, t, :t // 8])[::-1][:2].sum() + m[g, t, t // 8]
                    for t in range(24, 64) for g in range(m.shape[0])])
    assert abs(r["oracle_mass"]["layers"][0] - want) < 1e-5
