"""Optimizer pieces: schedules, weight-decay / trainable masks, MTP targets, cross-entropy sums,
optimizer-state sharding mirror, synthetic data layout, iterator-state encoding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.model import abstract_params
from minimax_jax.train.config import from_dict
from minimax_jax.train.data import SyntheticIterator, decode_state, encode_state
from minimax_jax.train.losses import cross_entropy_sums, mtp_targets, mtp_weights_list
from minimax_jax.train.model_init import model_configs
from minimax_jax.train.optimizer import (PHASE_MAIN, PHASE_WARMUP, decay_mask, held_router_biases, leaf_paths,
                                         make_optimizer, make_schedule, trainable_mask)
from tests.train_helpers import MICRO_MSA_MODEL, micro_train_dict


def _tc(tmp_path, **kw):
    return from_dict(micro_train_dict(str(tmp_path), model=MICRO_MSA_MODEL, **kw))


def test_cosine_and_wsd_schedules(tmp_path):
    tc = _tc(tmp_path, optim={"lr": 1.0}, schedule={"kind": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
             run={"steps": 110})
    s = make_schedule(tc)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5) and float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-3) and float(s(110)) == pytest.approx(0.1, abs=1e-6)
    tc = _tc(tmp_path, optim={"lr": 2.0}, schedule={"kind": "wsd", "warmup_steps": 10, "decay_fraction": 0.2,
                                                    "min_lr_ratio": 0.0}, run={"steps": 100})
    s = make_schedule(tc)
    assert float(s(10)) == pytest.approx(2.0) and float(s(79)) == pytest.approx(2.0)
    assert float(s(90)) == pytest.approx(1.0) and float(s(100)) == pytest.approx(0.0, abs=1e-6)
    # The MSA warm-up phase: its own lr; the main schedule starts after the warm-up steps.
    tc = _tc(tmp_path, optim={"lr": 1.0}, schedule={"kind": "constant", "warmup_steps": 4},
             msa={"indexer_warmup_steps": 20, "warmup_lr": 0.5}, run={"steps": 100})
    assert float(make_schedule(tc, PHASE_WARMUP)(10)) == pytest.approx(0.5)
    assert float(make_schedule(tc)(2)) == pytest.approx(0.5) and float(make_schedule(tc)(50)) == 1.0
    # ... decayed by a cosine to min_lr_ratio of it over the warm-up steps (ramp: 20 // 10 = 2 steps).
    tc = _tc(tmp_path, optim={"lr": 1.0}, schedule={"kind": "constant", "warmup_steps": 4, "min_lr_ratio": 0.1},
             msa={"indexer_warmup_steps": 20, "warmup_lr": 0.5, "warmup_schedule": "cosine"}, run={"steps": 100})
    w = make_schedule(tc, PHASE_WARMUP)
    assert float(w(1)) == pytest.approx(0.25) and float(w(2)) == pytest.approx(0.5)
    half = 0.5 * (1 + math.cos(math.pi * 9 / 17))        # count 11 of the decay's 2..19
    assert float(w(11)) == pytest.approx(0.05 + 0.45 * half, abs=1e-6)
    assert float(w(19)) == pytest.approx(0.05)           # the last warm-up step (optimizer count 19 of 0..19)
    assert float(make_schedule(tc)(50)) == 1.0


def test_masks(tmp_path):
    cfg, _ = model_configs(_tc(tmp_path))
    tree = abstract_params(cfg)
    paths = leaf_paths(tree)
    decay = dict(zip(paths, jax.tree.leaves(decay_mask(tree))))
    assert decay["segments/0/attn/q_proj"] and decay["embed/embedding"] and decay["segments/1/mlp/wi"]
    assert not decay["segments/0/input_norm/scale"] and not decay["segments/1/mlp/router_bias"]
    assert not decay["segments/1/attn/index_q_norm/scale"] and not decay["final_norm/scale"]
    train = dict(zip(paths, jax.tree.leaves(trainable_mask(tree, ("^embed/", "q_norm")))))
    assert not train["embed/embedding"] and not train["segments/0/attn/q_norm/scale"]
    assert not train["segments/1/mlp/router_bias"] and not train["mtp/0/layer/mlp/router_bias"]
    assert train["lm_head"] and train["segments/1/attn/index_q_proj"]
    only = dict(zip(paths, jax.tree.leaves(trainable_mask(tree, (), only_index=True))))
    assert {p for p, t in only.items() if t} == {p for p in paths if "/index_" in p}
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_optimizer(_tc(tmp_path, optim={"freeze": [".*"]}), tree, PHASE_MAIN)
    with pytest.raises(ValueError, match="'nomatch' matches no parameter"):       # a typo is not silently ignored
        make_optimizer(_tc(tmp_path, optim={"freeze": ["embed/", "nomatch"]}), tree, PHASE_MAIN)
    held = dict(zip(paths, jax.tree.leaves(held_router_biases(tree, ("^segments/1/",)))))
    assert held["segments/1/mlp/router_bias"] and not held["segments/1/mlp/wi"]
    assert not held["mtp/0/layer/mlp/router_bias"]


def test_mtp_modules_without_a_loss_are_frozen(tmp_path):
    """A trailing zero MTP weight drops that depth's loss, and the module is not trained (weight decay would
    otherwise move it)."""
    model = {**MICRO_MSA_MODEL, "num_mtp_modules": 2}
    tc = from_dict(micro_train_dict(str(tmp_path), model=model, optim={"mtp_weights": [1.0, 0.0]}))
    cfg, _ = model_configs(tc)
    tree = abstract_params(cfg)
    _, train, _ = make_optimizer(tc, tree, PHASE_MAIN)
    train = dict(zip(leaf_paths(tree), jax.tree.leaves(train)))
    assert train["mtp/0/eh_proj"] and not train["mtp/1/eh_proj"]
    assert not any(t for p, t in train.items() if p.startswith("mtp/1/"))


def test_mtp_targets_mask_boundaries():
    targets = jnp.array([[11, 12, 13, 14, 15, 16]])
    loss_mask = jnp.array([[1, 1, 0, 1, 1, 0]], jnp.float32)  # doc 1 = tokens 0..2, doc 2 = 3..5 (pad after)
    seg = jnp.array([[1, 1, 1, 2, 2, 2]])
    t1, m1 = mtp_targets(targets, loss_mask, seg, 1)
    assert t1.tolist() == [[12, 13, 14, 15, 16, 0]]
    assert m1.tolist() == [[1, 0, 0, 1, 0, 0]]  # t=1: target of token 2 is the next document's
    t2, m2 = mtp_targets(targets, loss_mask, seg, 2)
    assert m2.tolist() == [[0, 0, 0, 0, 0, 0]] and t2[0, :4].tolist() == [13, 14, 15, 16]
    assert mtp_weights_list(0.3, 2) == (0.3, 0.3) and mtp_weights_list([1, 2], 2) == (1.0, 2.0)
    assert mtp_weights_list(0, 2) == () and mtp_weights_list([1, 0], 2) == (1.0,)     # zero depths not computed
    assert mtp_weights_list([0, 1], 2) == (0.0, 1.0)     # depth 2 needs depth 1's hidden state
    with pytest.raises(ValueError):
        mtp_weights_list([1.0], 2)


def test_cross_entropy_sums_match_manual():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    tgt = rng.integers(0, 7, (2, 3))
    mask = np.array([[1, 0, 1], [1, 1, 0]], np.float32)
    ce, z = cross_entropy_sums(jnp.asarray(logits), jnp.asarray(tgt), jnp.asarray(mask))
    lse = np.log(np.exp(logits).sum(-1))
    want = ((lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]) * mask).sum()
    np.testing.assert_allclose(ce, want, rtol=1e-6)
    np.testing.assert_allclose(z, (lse ** 2 * mask).sum(), rtol=1e-6)


def test_synthetic_batches_follow_the_pipeline_layout():
    it = SyntheticIterator(32, 4, 100, seed=1, mean_doc_len=8)
    b = next(it)
    seg, pos, mask = b["segment_ids"], b["positions"], b["loss_mask"]
    assert all(v.shape == (4, 32) for v in b.values())
    np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])
    starts = np.diff(seg, axis=1) != 0
    assert starts.any() and (pos[:, 1:][starts] == 0).all()
    assert (mask[:, :-1][starts] == 0).all() and (mask[:, :-1][~starts] == 1).all()
    state = it.get_state()
    nxt = next(it)
    it2 = SyntheticIterator(32, 4, 100, seed=1, mean_doc_len=8)
    it2.set_state(decode_state(encode_state(state)))
    np.testing.assert_array_equal(next(it2)["tokens"], nxt["tokens"])


def test_state_encoding_round_trip():
    s = {"a": (1, b"\x00\xff", [np.int64(3), {"b": (2.5,)}]), "c": None}
    assert decode_state(encode_state(s)) == {"a": (1, b"\x00\xff", [3, {"b": (2.5,)}]), "c": None}
