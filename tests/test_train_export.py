"""A training run's params exported as an inference checkpoint load back exactly."""

import subprocess
import sys

import jax
import numpy as np

from minimax_jax.convert import load_checkpoint
from minimax_jax.train.export import export_run, latest_params


def test_export_run_roundtrip(tmp_path):
    run = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "--config", "configs/train/tiny-m3.yaml", "--set",
                    f"run.run_dir={run}", "--set", "run.steps=1", "--set", "run.progress=false",
                    "--set", "model.msa_impl=xla"],
                   check=True, capture_output=True, timeout=600)
    step, trained = latest_params(str(run))
    out = export_run(str(run), str(tmp_path / "ckpt"), dtype="float32", hf_dst=str(tmp_path / "hf"))
    assert out["step"] == step == 1 and out["hf"]["tensors"] > 0
    cfg, params = load_checkpoint(tmp_path / "ckpt")
    assert (cfg.msa_impl, cfg.attention_impl, cfg.moe_impl) == ("auto",) * 3   # the run forced xla
    a = jax.tree_util.tree_flatten_with_path(trained)[0]
    b = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0])
    assert len(a) == len(b)
    for k, v in a:
        np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(b[jax.tree_util.keystr(k)], np.float32))
    assert (tmp_path / "hf" / "config.json").exists()
