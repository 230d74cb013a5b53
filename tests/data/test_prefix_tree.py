"""The prefix-tree packer against brute force: each trajectory is a path of visible slots, visibility is
exactly the ancestor relation, weights count every original token (as a target and as an input) once per occurrence, merging is maximal."""

import numpy as np
import pytest

from minimax_jax.data.prefix_tree import Trajectory, TreePackingError, ancestor_mask, pack_trajectories


def _random_trajs(rng, n, vocab=5):
    """Random trajectories over a tiny vocabulary (so prefixes are shared often), some duplicates/prefixes."""
    out = []
    for _ in range(n):
        if out and rng.random() < 0.3:
            base = out[rng.integers(len(out))].tokens
            cut = int(rng.integers(1, base.size + 1))
            toks = np.concatenate([base[:cut], rng.integers(0, vocab, size=int(rng.integers(0, 6)))])
        else:
            toks = rng.integers(0, vocab, size=int(rng.integers(1, 12)))
        out.append(Trajectory(toks, rng.random(toks.size).astype(np.float32)))
    return out


def _path(rows, vis, traj, taken, leaf):
    """The slots (row, [slot per depth]) holding ``traj``: found from the last token's visible set only
    (with ``leaf``, unmerged rows: a last slot no other slot sees, not in ``taken``)."""
    n = traj.tokens.size
    for r in range(rows["tokens"].shape[0]):
        for i in np.flatnonzero((rows["positions"][r] == n - 1) & (rows["segment_ids"][r] > 0)):
            seen = np.flatnonzero(vis[r, i])
            if leaf and ((r, i) in taken or vis[r, :, i].sum() != 1):
                continue
            if seen.size == n and np.array_equal(rows["tokens"][r, seen], traj.tokens):
                return r, seen
    raise AssertionError(f"trajectory {traj.tokens} not found as a path of visible slots")


def _check(trajs, rows, stats, merged=True):
    vis = ancestor_mask(rows)
    weights = np.zeros_like(rows["loss_mask"])
    inputs = np.zeros_like(rows["loss_mask"])
    on_path = np.zeros(rows["tokens"].shape, bool)
    taken = set()
    for t in trajs:
        r, p = _path(rows, vis, t, taken, not merged)
        if not merged:
            taken.add((r, p[-1]))
        np.testing.assert_array_equal(rows["positions"][r, p], np.arange(t.tokens.size))
        for d, s in enumerate(p):      # every slot on the path sees exactly the path up to itself
            np.testing.assert_array_equal(np.flatnonzero(vis[r, s]), p[: d + 1])
            assert rows["loss_index"][r, s] == (p[d - 1] if d else s)
        weights[r, p[1:]] += t.loss_mask[1:]
        inputs[r, p[:-1]] += 1.0          # every token but the last is an input of this trajectory
        on_path[r, p] = True
    np.testing.assert_allclose(rows["loss_mask"], weights, rtol=1e-6)
    np.testing.assert_array_equal(rows["input_weight"], inputs)
    np.testing.assert_array_equal(rows["targets"], rows["tokens"])
    real = rows["segment_ids"] > 0
    np.testing.assert_array_equal(on_path, real)          # no slot that belongs to no trajectory
    assert stats.tokens_after == real.sum() and stats.tokens_before == sum(t.tokens.size for t in trajs)
    pad = ~real
    slot = np.broadcast_to(np.arange(real.shape[1]), real.shape)
    np.testing.assert_array_equal(rows["subtree_end"][pad], slot[pad] + 1)   # padding sees only itself


@pytest.mark.parametrize("seed", range(6))
def test_packer_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    trajs = _random_trajs(rng, 12)
    rows, stats = pack_trajectories(trajs, 48)
    _check(trajs, rows, stats)
    distinct = {(tuple(t.tokens[: d + 1].tolist())) for t in trajs for d in range(t.tokens.size)}
    assert stats.tokens_after == len(distinct)             # maximal merging: one slot per distinct prefix
    assert stats.saving == pytest.approx(1 - len(distinct) / stats.tokens_before)


def test_large_tree_is_split_by_duplicating_the_shared_prefix():
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 50, size=20)
    trajs = [Trajectory(np.concatenate([prompt, rng.integers(0, 50, size=15)]), np.ones(35, np.float32))
             for _ in range(5)]
    rows, stats = pack_trajectories(trajs, 70)             # 20 + 5 * 15 = 95 > 70: groups of 3 and 2
    _check(trajs, rows, stats)
    assert stats.rows == 2 and stats.tokens_after == 2 * 20 + 5 * 15


def test_unmerged_layout_and_errors():
    rng = np.random.default_rng(2)
    trajs = _random_trajs(rng, 6)
    rows, stats = pack_trajectories(trajs, 64, merge=False)
    _check(trajs, rows, stats, merged=False)
    assert stats.tokens_after == stats.tokens_before
    with pytest.raises(TreePackingError, match="more than seq_len"):
        pack_trajectories([Trajectory(np.arange(10), np.ones(10))], 8)
    with pytest.raises(TreePackingError, match="need 3 rows"):
        pack_trajectories([Trajectory(np.full(8, i), np.ones(8)) for i in range(3)], 8, num_rows=2)
