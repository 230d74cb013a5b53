"""MSA ops with prefix-tree visibility (``kv_subtree_end``) and weighted KL rows (``q_weights``): each query
of a packed tree sees exactly its own trajectory (block scores, selection, attention and KL equal those of
the trajectory computed alone), ``"auto"`` resolves to the XLA reference with the kernels' reason recorded
even where a GPU would be used, explicit kernels refuse, and bad inputs get a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minimax_jax.ops  # noqa: F401  (registers every op)
from minimax_jax.data.prefix_tree import Trajectory, pack_trajectories
from minimax_jax.ops import registry
from minimax_jax.ops.msa import indexer_kl, msa_attention, msa_index_scores, msa_select_blocks
from minimax_jax.ops.registry import ImplementationUnavailable

BLK, K, H, G, D = 8, 3, 4, 2, 16


def _packed():
    """Two trajectories sharing 21 tokens (branch inside block 2), a third sharing 16 (on a block edge)."""
    rng = np.random.default_rng(0)
    base = rng.integers(1, 50, 40)
    toks = [base, np.concatenate([base[:21], rng.integers(1, 50, 19)]), np.concatenate([base[:16], rng.integers(1, 50, 9)])]
    trajs = [Trajectory(t, np.ones(t.size, np.float32)) for t in toks]
    rows, _ = pack_trajectories(trajs, 72, 1)
    return toks, rows


def _arrays(rng, n):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return f(1, n, H, D), f(1, n, G, D), f(1, n, G, D), f(1, n, G, D), f(1, n, D)


def test_each_query_sees_its_own_trajectory():
    toks, rows = _packed()
    n = rows["tokens"].shape[1]
    # Per-slot features from the slot's token, so a trajectory computed alone has the same inputs.
    table = _arrays(np.random.default_rng(1), 64)
    feats = [x[0, rows["tokens"][0]][None] for x in table]
    pos, seg, end = (jnp.asarray(rows[k]) for k in ("positions", "segment_ids", "subtree_end"))
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, block_size=BLK,
              kv_subtree_end=end)
    q, k, v, qi, ki = feats
    scores = np.asarray(msa_index_scores(qi, ki, **kw))
    ids = msa_select_blocks(qi, ki, topk=K, **kw)
    o, lse = msa_attention(q, k, v, ids, **kw)
    for t in toks:          # the trajectory alone, and where its tokens sit in the packed row
        m = t.size
        slots = [int(np.flatnonzero((rows["tokens"][0] == t[i]) & (rows["positions"][0] == i)
                                    & _on_path(rows, t, i))[0]) for i in range(m)]
        alone = [x[0, t][None] for x in table]
        p1 = jnp.arange(m, dtype=jnp.int32)[None]
        kw1 = dict(q_positions=p1, kv_positions=p1, block_size=BLK)
        aq, ak, av, aqi, aki = alone
        s1 = np.asarray(msa_index_scores(aqi, aki, **kw1))[0]
        nb = s1.shape[-1]
        np.testing.assert_allclose(scores[0][:, slots, :nb], s1, rtol=1e-5, atol=1e-6)
        assert np.all(np.isneginf(scores[0][:, slots, nb:]))
        ids1 = np.asarray(msa_select_blocks(aqi, aki, topk=K, **kw1))[0]
        assert [set(r) for r in np.asarray(ids)[0][:, slots].reshape(-1, K).tolist()] == \
               [set(r) for r in ids1.reshape(-1, K).tolist()]
        o1, lse1 = msa_attention(aq, ak, av, jnp.asarray(ids1)[None], **kw1)
        np.testing.assert_allclose(np.asarray(o)[0, slots], np.asarray(o1)[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse)[0, slots], np.asarray(lse1)[0], rtol=1e-5, atol=1e-6)   # an LSE near 0: absolute
    assert n == 72


def _on_path(rows, t, i):
    """Slots whose trajectory prefix (root to slot) equals ``t[:i + 1]``."""
    end = rows["subtree_end"][0]
    out = np.zeros(end.size, bool)
    for s in range(end.size):
        anc = [j for j in range(s + 1) if j <= s < end[j] and rows["segment_ids"][0, j] == rows["segment_ids"][0, s]]
        out[s] = len(anc) == i + 1 and np.array_equal(rows["tokens"][0, anc], t[:i + 1])
    return out


def test_weighted_kl_counts_each_row_its_weight():
    rng = np.random.default_rng(2)
    n = 24
    q, k, _, qi, ki = _arrays(rng, n)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    kw = dict(q_positions=pos, kv_positions=pos)
    s1, c1 = indexer_kl(q, k, qi, ki, None, **kw)
    w = jnp.asarray(rng.integers(0, 4, (1, n)), jnp.float32)
    sw, cw = indexer_kl(q, k, qi, ki, None, q_weights=w, **kw)
    # Row i counted w_i times == the unweighted op over the rows repeated w_i times (one row each call).
    rows = [indexer_kl(q[:, :i + 1], k[:, :i + 1], qi[:, :i + 1], ki[:, :i + 1], None,
                       q_positions=pos[:, :i + 1], kv_positions=pos[:, :i + 1])[0]
            - (indexer_kl(q[:, :i], k[:, :i], qi[:, :i], ki[:, :i], None, q_positions=pos[:, :i],
                          kv_positions=pos[:, :i])[0] if i else 0.0) for i in range(n)]
    np.testing.assert_allclose(float(sw), float(np.dot(np.asarray(w)[0], np.asarray(rows))), rtol=1e-5)
    assert float(cw) == float(w.sum()) * G and int(c1) == n * G
    np.testing.assert_allclose(float(s1), float(np.sum(rows)), rtol=1e-5)


def test_kernels_refuse_trees_and_auto_runs_xla():
    _, rows = _packed()
    n = rows["tokens"].shape[1]
    pos = jnp.asarray(rows["positions"])
    end = jnp.asarray(rows["subtree_end"])
    S = jax.ShapeDtypeStruct
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=pos * 0, kv_segment_ids=pos * 0, block_size=64,
              chunk_size=256, kv_subtree_end=end)
    q, kv = S((1, n, 64, 128), jnp.bfloat16), S((1, n, 4, 128), jnp.bfloat16)
    ids = S((1, 4, n, 4), jnp.int32)
    with registry.assume_backend("gpu"):
        assert registry.resolve("msa_attention", "auto", q, kv, kv, ids, **kw).name == "xla"
        for name in ("pallas_gpu", "pallas_hopper_gpu"):
            with pytest.raises(ImplementationUnavailable, match="prefix-tree visibility"):
                registry.resolve("msa_attention", name, q, kv, kv, ids, **kw)
        # weighted KL rows (the key layout's merged queries): the GPU KL kernels take them, TPU's do not
        ar = jnp.arange(n, dtype=jnp.int32)[None]               # an ordinary (key-layout-like) run
        kw2 = dict(kw, q_positions=ar, kv_positions=ar)
        del kw2["kv_subtree_end"]
        kl_args = (q, kv, S((1, n, 4, 128), jnp.bfloat16), S((1, n, 128), jnp.bfloat16), ids)
        wts = S((1, n), jnp.float32)
        assert registry.resolve("indexer_kl", "auto", *kl_args, q_weights=wts, **kw2).name == "pallas_gpu"
        with pytest.raises(ImplementationUnavailable, match="weighted KL rows"):
            registry.resolve("indexer_kl", "pallas_tpu_interpret", *kl_args, q_weights=wts, **kw2)


def test_bad_tree_inputs_get_one_line_errors():
    rng = np.random.default_rng(3)
    q, k, v, qi, ki = _arrays(rng, 16)
    pos = jnp.arange(16, dtype=jnp.int32)[None]
    kw = dict(q_positions=pos, kv_positions=pos, block_size=BLK)
    with pytest.raises(ValueError, match="kv_subtree_end must have shape"):
        msa_select_blocks(qi, ki, topk=K, kv_subtree_end=jnp.ones((1, 15), jnp.int32), **kw)
    with pytest.raises(ValueError, match="needs self-attention T == S"):
        msa_attention(q[:, :8], k, v, jnp.zeros((1, G, 8, K), jnp.int32), kv_subtree_end=pos + 1,
                      q_positions=pos[:, :8], kv_positions=pos, block_size=BLK)
    with pytest.raises(ValueError, match="q_weights must have shape"):
        indexer_kl(q, k, qi, ki, None, q_weights=jnp.ones((1, 15)), q_positions=pos, kv_positions=pos)
