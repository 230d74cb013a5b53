"""Prefix-tree merging is exact: the merged batch's loss and every gradient equal the unmerged batch's
(tiny M2 model, fp32), for trees of 1-6 levels, branch points inside and on 64/128-token block
boundaries, several trees per row, a trajectory that is a prefix of another, and duplicates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import load_config
from minimax_jax.data.prefix_tree import Trajectory, pack_trajectories
from minimax_jax.model import init_params
from minimax_jax.train.step import StepSpec, _loss_fn, batch_norms

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(load_config("tiny-m2"), vocab_size=VOCAB, num_layers=2, layer_types=("full",) * 2,
                              mlp_types=("moe", "dense"), dense_intermediate_size=24)
    return cfg, init_params(cfg, jax.random.key(0))


def _tree(rng, spec, prefix=()):
    """Trajectories of a tree: ``spec`` = (segment length, [child specs]) -> list of token lists."""
    n, children = spec
    seq = list(prefix) + rng.integers(1, VOCAB, size=n).tolist()
    if not children:
        return [seq]
    return [t for c in children for t in _tree(rng, c, seq)]


def _trajs(rng, token_lists):
    return [Trajectory(np.asarray(t, np.int32), (rng.random(len(t)) < 0.7).astype(np.float32)) for t in token_lists]


def _unmerged(trajs, pad_segment: int = 0):
    """The reference batch: one trajectory per row, the pipeline layout (targets = next token); padding in
    segment ``pad_segment`` (-1: no key visible, so no MSA indexer-KL row)."""
    n = max(t.tokens.size for t in trajs) - 1
    b = {k: np.zeros((len(trajs), n), np.int32) for k in ("tokens", "targets", "positions")}
    b["segment_ids"] = np.full((len(trajs), n), pad_segment, np.int32)
    b["loss_mask"] = np.zeros((len(trajs), n), np.float32)
    for r, t in enumerate(trajs):
        m = t.tokens.size - 1
        b["tokens"][r, :m], b["targets"][r, :m] = t.tokens[:-1], t.tokens[1:]
        b["segment_ids"][r, :m], b["positions"][r, :m] = 1, np.arange(m)
        b["loss_mask"][r, :m] = t.loss_mask[1:]
    return b


def _value_and_grad(spec, params, batch):
    """The training loss of ``spec`` on ``batch``: ``(loss, metrics, norms, grads)``."""
    trainable = jax.tree.map(lambda _: True, params)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    norms = batch_norms(batch, 0)
    (loss, m), g = jax.jit(jax.value_and_grad(_loss_fn(spec, trainable), has_aux=True))(params, batch, norms)
    return float(loss), m, norms, g


def _loss_and_grads(cfg, params, batch, z_loss):
    loss, _, norms, g = _value_and_grad(StepSpec(cfg=cfg, z_loss=z_loss), params, batch)
    return loss, float(norms["tokens"]), g


def _assert_grads_equal(g_ref, g_got):
    """Every leaf within 1e-5 (relative, or of the leaf's largest entry); some gradient is non-zero."""
    flat_ref, _ = jax.tree_util.tree_flatten_with_path(g_ref)
    for (path, a), b in zip(flat_ref, jax.tree.leaves(g_got)):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(np.abs(a).max(), 1e-30)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(g_ref))


CASES = {
    # name: (tree specs, seq_len, num_rows)
    "one_level": ([(40, [])], 64, 1),
    "two_levels_inside_block": ([(37, [(20, []), (25, []), (11, [])])], 128, 1),
    "on_block_64": ([(64, [(30, []), (30, [(10, []), (12, [])])])], 256, 1),
    "on_block_128": ([(128, [(40, []), (33, [])]), (9, [(5, []), (7, [])])], 256, 1),
    "six_levels": ([(10, [(9, [(8, [(7, [(6, [(5, []), (4, [])]), (6, [])]), (3, [])]), (5, [])]), (2, [])])], 128, 1),
    "several_trees_per_row": ([(12, [(6, []), (7, [])]), (15, [(3, []), (4, [])]), (20, [])], 64, 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_merged_loss_and_grads_equal_unmerged(model, name):
    cfg, params = model
    specs, seq_len, rows = CASES[name]
    rng = np.random.default_rng(len(name))
    tokens = [t for s in specs for t in _tree(rng, s)]
    if name == "several_trees_per_row":   # a prefix of another trajectory and a duplicate
        tokens += [tokens[0][:15], list(tokens[1])]
    trajs = _trajs(rng, tokens)
    packed, stats = pack_trajectories(trajs, seq_len, rows)
    assert stats.tokens_after < stats.tokens_before or len(tokens) == 1
    l_ref, n_ref, g_ref = _loss_and_grads(cfg, params, _unmerged(trajs), 1e-3)
    l_tree, n_tree, g_tree = _loss_and_grads(cfg, params, packed, 1e-3)
    assert n_ref == n_tree
    np.testing.assert_allclose(l_tree, l_ref, rtol=1e-5)
    _assert_grads_equal(g_ref, g_tree)


def test_merged_row_unmerged_layout_also_equal(model):
    """``merge=False`` (each trajectory its own chain, packed) gives the same loss: the baseline layout."""
    cfg, params = model
    rng = np.random.default_rng(7)
    trajs = _trajs(rng, _tree(rng, (30, [(10, []), (14, [])])))
    flat, s_flat = pack_trajectories(trajs, 128, 1, merge=False)
    tree, s_tree = pack_trajectories(trajs, 128, 1)
    assert s_flat.tokens_after == s_flat.tokens_before == 84 and s_tree.tokens_after == 54
    loss = _loss_and_grads(cfg, params, tree, 0.0)[0]
    np.testing.assert_allclose(_loss_and_grads(cfg, params, flat, 0.0)[0], loss, rtol=1e-5)
    blind = {k: v for k, v in tree.items() if k != "subtree_end"}      # no tree visibility: siblings leak
    assert abs(_loss_and_grads(cfg, params, blind, 0.0)[0] - loss) > 2e-5 * abs(loss)   # twice the tolerance above
