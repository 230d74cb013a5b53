"""Prefix-tree visibility (``kv_subtree_end``) in the attention op: the XLA reference against an fp32
numpy softmax over the brute-force ancestor mask, every element; the fast paths other than the tree kernel
(tests/kernels/tree) refuse it, ``auto`` picks xla on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.data.prefix_tree import Trajectory, pack_trajectories
from minimax_jax.ops import registry
from minimax_jax.ops.attention import IMPLEMENTATIONS, attention
from minimax_jax.ops.registry import ImplementationUnavailable


def _rows():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 9, size=11)
    toks = [np.concatenate([prompt, rng.integers(0, 9, size=n)]) for n in (5, 9, 0, 3)] + [rng.integers(0, 9, size=7)]
    return pack_trajectories([Trajectory(t, np.ones(t.size)) for t in toks], 40, 2)[0]


def _reference(q, k, v, rows, window):
    """Brute force: per query, the keys of its own trajectory (root-to-slot path via the parent links)."""
    b, t, h, d = q.shape
    g = k.shape[2]
    out = np.zeros((b, t, h, d), np.float32)
    for r in range(b):
        for i in range(t):
            path, s = [i], i
            while rows["loss_index"][r, s] != s:
                s = rows["loss_index"][r, s]
                path.append(s)
            keys = np.array([j for j in path if window is None
                             or rows["positions"][r, i] - rows["positions"][r, j] < window])
            for hh in range(h):
                logits = k[r, keys, hh // (h // g)] @ q[r, i, hh] / np.sqrt(d)
                p = np.exp(logits - logits.max())
                out[r, i, hh] = (p / p.sum()) @ v[r, keys, hh // (h // g)]
    return out


@pytest.mark.parametrize("chunk,window", [(512, None), (16, None), (16, 4)])
def test_xla_tree_attention_matches_brute_force(chunk, window):
    rows = _rows()
    b, t = rows["tokens"].shape
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (b, t, 4, 8), jnp.float32)
    k = jax.random.normal(kk, (b, t, 2, 8), jnp.float32)
    v = jax.random.normal(kv, (b, t, 2, 8), jnp.float32)
    pos, seg = jnp.asarray(rows["positions"]), jnp.asarray(rows["segment_ids"])
    registry.clear_implementation_report()
    out = attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                    sliding_window=window, implementation="auto", chunk_size=chunk,
                    kv_subtree_end=jnp.asarray(rows["subtree_end"]))
    assert registry.implementation_report()["attention"] == "xla"
    np.testing.assert_allclose(np.asarray(out), _reference(*map(np.asarray, (q, k, v)), rows, window),
                               rtol=1e-5, atol=1e-6)


def test_other_implementations_refuse_tree_visibility():
    rows = _rows()
    b, t = rows["tokens"].shape
    q = jnp.ones((b, t, 2, 16), jnp.float32)
    kw = dict(q_positions=jnp.asarray(rows["positions"]), kv_positions=jnp.asarray(rows["positions"]),
              q_segment_ids=jnp.asarray(rows["segment_ids"]), kv_segment_ids=jnp.asarray(rows["segment_ids"]),
              kv_subtree_end=jnp.asarray(rows["subtree_end"]))
    runnable_here = [n for n in IMPLEMENTATIONS if (n.endswith("_interpret") or n == "xla_banded")
                     and not n.startswith("pallas_tree")]
    assert len(runnable_here) >= 3
    for name in runnable_here:
        with pytest.raises(ImplementationUnavailable, match="prefix-tree"):
            attention(q, q, q, implementation=name, sliding_window=8 if name == "xla_banded" else None, **kw)
    with pytest.raises(ValueError, match="kv_subtree_end"):
        attention(q, q[:, :-1], q[:, :-1], implementation="xla", **{**kw, "kv_positions": kw["kv_positions"][:, :-1]})
