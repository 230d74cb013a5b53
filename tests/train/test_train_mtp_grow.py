"""Growing a checkpoint's MTP modules (``init.mode: checkpoint`` with more ``model.num_mtp_modules``) and
self-distilled MTP targets (``optim.mtp_targets: self``)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.convert.atomic_dir import PARAMS_DIR, write_config
from minimax_jax.model import forward, init_params, mtp_forward
from minimax_jax.train import train
from minimax_jax.train.config import TrainConfigError, from_dict
from minimax_jax.train.losses import cross_entropy_sums, greedy_ids, mtp_targets
from minimax_jax.train.model_init import model_configs, resize_mtp
from minimax_jax.train.optimizer import leaf_paths
from tests.train_helpers import MICRO_MSA_MODEL, micro_train_dict


def _checkpoint(d, mtp=1):
    cfg = ModelConfig.from_dict({k: v for k, v in MICRO_MSA_MODEL.items() if k != "name"} | {
        "num_mtp_modules": mtp, "dtype": "float32", "param_dtype": "float32"})
    os.makedirs(d)
    write_config(cfg, d)
    params = init_params(cfg, jax.random.key(7))
    with ocp.StandardCheckpointer() as c:
        c.save(os.path.join(os.path.abspath(d), PARAMS_DIR), params)
    return cfg, params


def _final_params(run_dir, step):
    return ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), "state"))["params"]


def test_resize_mtp_copies_and_drops():
    cfg = ModelConfig.from_dict({k: v for k, v in MICRO_MSA_MODEL.items() if k != "name"} | {"num_mtp_modules": 2})
    p = init_params(cfg, jax.random.key(0))
    grown = resize_mtp(p, 4)
    assert len(grown["mtp"]) == 4
    for a, b, c in zip(jax.tree.leaves(p["mtp"][1]), jax.tree.leaves(grown["mtp"][2]), jax.tree.leaves(grown["mtp"][3])):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        assert b.unsafe_buffer_pointer() != a.unsafe_buffer_pointer()     # new buffers (the step donates them)
    for a, b in zip(jax.tree.leaves(p["mtp"][0]), jax.tree.leaves(grown["mtp"][0])):
        np.testing.assert_array_equal(a, b)
    assert len(resize_mtp(p, 1)["mtp"]) == 1 and "mtp" not in resize_mtp(p, 0)
    with pytest.raises(ValueError, match="no MTP module"):
        resize_mtp(resize_mtp(p, 0), 2)
    with pytest.raises(ValueError, match=">= 0"):
        resize_mtp(p, -1)


def test_grow_mtp_trains_only_new_modules(tmp_path):
    ckpt = str(tmp_path / "ck")
    _, stored = _checkpoint(ckpt, mtp=1)
    run_dir = str(tmp_path / "run")
    tc = from_dict(micro_train_dict(
        run_dir, model={"num_mtp_modules": 3}, init={"mode": "checkpoint", "path": ckpt},
        data={"kind": "synthetic", "seq_len": 48, "batch_size": 2, "mean_doc_len": 40},
        optim={"lr": 1e-2, "mtp_weights": 1.0, "mtp_targets": "self", "router_bias_rate": 0.0,
               "freeze": ["^(?!mtp/[1-9])", "/index_"]},
        msa={"kl_coeff": 0.0}, run={"steps": 2}, checkpoint={"every": 2, "async_save": False}))
    cfg, src = model_configs(tc)
    assert cfg.num_mtp_modules == 3 and src.num_mtp_modules == 1
    out = train(tc)
    assert out["status"] == "completed"
    p = _final_params(run_dir, 2)
    assert len(p["mtp"]) == 3
    st = {path: a for path, a in zip(leaf_paths(stored), jax.tree.leaves(stored))}
    moved = 0
    for path, a in zip(leaf_paths(p), jax.tree.leaves(p)):
        if path.startswith(("mtp/1/", "mtp/2/")):
            ref = st[path.replace("mtp/1/", "mtp/0/").replace("mtp/2/", "mtp/0/")]
            if "/index_" in path or path.endswith("router_bias"):
                np.testing.assert_array_equal(a, ref, err_msg=path)   # frozen: still module 1's copy
            else:
                moved += not np.array_equal(a, ref)
        else:
            np.testing.assert_array_equal(a, st[path], err_msg=f"{path} (frozen) moved")
    assert moved >= 10


@pytest.mark.parametrize("mode,stored,match", [("checkpoint", 0, "no MTP module to copy"),
                                                ("sparse_cpt", 1, "sparse_cpt keeps the checkpoint's 1 MTP modules")])
def test_mtp_count_changes_refused(tmp_path, mode, stored, match):
    ckpt = str(tmp_path / "ck")
    _checkpoint(ckpt, mtp=stored)
    tc = from_dict(micro_train_dict(str(tmp_path / "run"), model={"num_mtp_modules": 2},
                                    init={"mode": mode, "path": ckpt}))
    with pytest.raises(TrainConfigError, match=match):
        model_configs(tc)


def test_mtp_targets_must_be_known(tmp_path):
    with pytest.raises(TrainConfigError, match="mtp_targets"):
        from_dict(micro_train_dict(str(tmp_path), optim={"mtp_targets": "teacher"}))


def test_greedy_ids_chunked_equals_whole():
    k1, k2 = jax.random.split(jax.random.key(3))
    h = jax.random.normal(k1, (2, 13, 16), jnp.float32)
    w = jax.random.normal(k2, (16, 50), jnp.float32)
    whole = greedy_ids(h @ w)
    assert whole.shape == (2, 13) and whole.dtype == jnp.int32
    np.testing.assert_array_equal(whole, jnp.argmax(h @ w, -1))
    for chunk in (1, 4, 13, 32):
        np.testing.assert_array_equal(greedy_ids(h, w, chunk), whole)


def test_self_targets_are_the_main_models_greedy_tokens():
    """MTP depth d at position t is scored against argmax of the main logits at t + d (what verification of
    draft d accepts), through the training loss."""
    from minimax_jax.train.step import StepSpec, _loss_fn, batch_norms

    cfg = ModelConfig.from_dict({k: v for k, v in MICRO_MSA_MODEL.items() if k != "name"} | {
        "num_mtp_modules": 2, "dtype": "float32", "param_dtype": "float32"})
    params = init_params(cfg, jax.random.key(1))
    t = 24
    tokens = jax.random.randint(jax.random.key(2), (2, t), 3, cfg.vocab_size)
    mb = {"tokens": tokens, "targets": jnp.roll(tokens, -1, 1), "positions": jnp.broadcast_to(jnp.arange(t), (2, t)),
          "segment_ids": jnp.ones((2, t), jnp.int32), "loss_mask": jnp.ones((2, t), jnp.float32).at[:, -1].set(0)}
    norms = batch_norms(mb, 2)
    trainable = jax.tree.map(lambda _: True, params)
    out = forward(params, cfg, tokens, positions=mb["positions"], segment_ids=mb["segment_ids"], return_hidden=True)
    greedy = jnp.argmax(out.logits, -1).astype(jnp.int32)
    outs = mtp_forward(params, cfg, out.hidden, tokens, positions=mb["positions"], segment_ids=mb["segment_ids"])
    for chunk in (0, 8):
        spec = StepSpec(cfg=cfg, mtp_weights=(1.0, 1.0), mtp_self_targets=True, logits_chunk=chunk)
        _, m = _loss_fn(spec, trainable)(params, mb, norms)
        for d, lg in enumerate(outs, start=1):
            tgt, md = mtp_targets(greedy, mb["loss_mask"], mb["segment_ids"], d)
            want = cross_entropy_sums(lg, tgt, md)[0] / norms[f"mtp{d}"]
            np.testing.assert_allclose(m[f"mtp_loss/{d}"], want, rtol=1e-5)
        data = StepSpec(cfg=cfg, mtp_weights=(1.0, 1.0), logits_chunk=chunk)
        _, md_ = _loss_fn(data, trainable)(params, mb, norms)
        assert abs(float(md_["mtp_loss/1"]) - float(m["mtp_loss/1"])) > 1e-3   # the data targets differ
