"""Sparse continued pre-training end to end: a dense checkpoint becomes MSA, the indexer warms up
with the backbone frozen (dense KL), then everything trains sparse."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from minimax_jax.config import ModelConfig
from minimax_jax.convert.atomic_dir import PARAMS_DIR, write_config
from minimax_jax.model import init_params
from minimax_jax.train import train
from minimax_jax.train.config import from_dict
from minimax_jax.train.optimizer import leaf_paths
from tests.train_helpers import MICRO_MODEL, micro_train_dict


def _dense_checkpoint(d):
    cfg = ModelConfig.from_dict({k: v for k, v in MICRO_MODEL.items() if k != "name"} | {
        "layer_types": "full", "mlp_types": "moe", "dtype": "float32", "param_dtype": "float32"})
    os.makedirs(d)
    write_config(cfg, d)
    with ocp.StandardCheckpointer() as c:
        c.save(os.path.join(os.path.abspath(d), PARAMS_DIR), init_params(cfg, jax.random.key(4)))
    return cfg


def _params_at(run_dir, step):
    state = ocp.StandardCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step), "state"))
    return state["params"]


def test_sparse_cpt_warmup_then_sparse(tmp_path):
    ckpt = str(tmp_path / "dense")
    _dense_checkpoint(ckpt)
    run_dir = str(tmp_path / "run")
    tc = from_dict(micro_train_dict(
        run_dir, model={}, init={"mode": "sparse_cpt", "path": ckpt},
        data={"kind": "synthetic", "seq_len": 48, "batch_size": 2, "mean_doc_len": 40},
        msa={"indexer_warmup_steps": 2, "kl_coeff": 0.5, "freeze_backbone_in_warmup": True, "warmup_lr": 1e-2,
             "index": {"index_block_size": 8, "index_topk": 2, "index_head_dim": 16}},
        run={"steps": 4, "recall_every": 4}, checkpoint={"every": 2, "async_save": False}))
    out = train(tc)
    assert out["status"] == "completed" and out["step"] == 4
    all_rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in all_rows if "loss" in r]
    assert [r["phase_warmup"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    recall = [r for r in all_rows if "indexer_recall" in r]
    assert len(recall) == 1 and recall[0]["step"] == 4 and 0.0 <= recall[0]["indexer_recall"] <= 1.0
    assert all(r["indexer_kl"] > 0 for r in rows)
    dense = ocp.StandardCheckpointer().restore(os.path.join(ckpt, PARAMS_DIR))
    p2, p4 = _params_at(run_dir, 2), _params_at(run_dir, 4)
    for path, a, b, c in zip(leaf_paths(p2), jax.tree.leaves(p2), jax.tree.leaves(p4), _leaves_like(dense, p2)):
        if path.endswith("router_bias"):
            # backbone state too: the balancing rule is off while the backbone is frozen
            np.testing.assert_array_equal(a, c, err_msg=f"{path} moved during the frozen warm-up")
            continue
        if "/index_" in path:
            assert c is None  # new leaves: the dense checkpoint has none
            continue
        np.testing.assert_array_equal(a, c, err_msg=f"{path} moved during the frozen warm-up")
        if path != "final_norm/scale" and not path.endswith("norm/scale"):
            assert not np.array_equal(a, b), f"{path} did not train after the warm-up"


def _leaves_like(dense, tree):
    """Leaves of ``dense`` at ``tree``'s paths (None where ``dense`` lacks the path)."""
    out = []
    for path in leaf_paths(tree):
        node = dense
        for part in path.split("/"):
            if isinstance(node, (list, tuple)):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                node = None
                break
        out.append(node)
    return out
