"""A tiny MoE model's loss falls on real text (Python standard-library sources, byte-level BPE),
held-out loss is evaluated, and TensorBoard / JSONL metrics are written."""

import json
import os

import numpy as np

from minimax_jax.train import train
from minimax_jax.train.config import from_dict
from tests.train_helpers import micro_train_dict, stdlib_corpus


def test_loss_falls_on_stdlib_source(tmp_path):
    text, tok = stdlib_corpus(str(tmp_path / "corpus"), max_files=40)
    files = sorted(os.listdir(text))
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    for f in files[-4:]:  # held-out documents never seen in training
        os.replace(os.path.join(text, f), heldout / f)
    run_dir = str(tmp_path / "run")
    tc = from_dict(micro_train_dict(
        run_dir, data={"kind": "grain", "sources": [text], "tokenizer": tok, "seq_len": 64, "batch_size": 8,
                       "num_epochs": None},
        optim={"lr": 1e-2, "weight_decay": 0.01, "clip_norm": 1.0},
        schedule={"kind": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
        checkpoint={"every": 0},
        run={"steps": 60, "log_every": 1, "eval_every": 30, "eval_batches": 2, "eval_sources": [str(heldout)],
             "tensorboard": True, "peak_tflops": 1.0}))
    out = train(tc)
    assert out["status"] == "completed"
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    loss = [r["lm_loss"] for r in rows if "lm_loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(loss) == 60 and loss[0] > np.log(384) - 0.3  # starts near uniform over the vocabulary
    assert np.mean(loss[-10:]) < np.mean(loss[:3]) - 1.0, loss
    assert len(evals) == 2 and evals[1] < evals[0] and evals[1] < np.log(384) - 1.0, evals
    last = rows[-1]
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "moe/max_load_ratio", "z_loss"):
        assert key in last and np.isfinite(last[key]), key
    assert 0 < last["mfu"] < 1
    tb = os.listdir(os.path.join(run_dir, "tensorboard"))
    assert any(f.startswith("events.out.tfevents") for f in tb)
