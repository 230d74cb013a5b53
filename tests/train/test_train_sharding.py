"""Data / FSDP / tensor / expert parallel training on 8 simulated CPU devices gives the same losses
and parameters as one device (run in a subprocess: the device count is fixed at JAX start-up)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.train_helpers import REPO, subprocess_env

SCRIPT = r"""
import json, sys
import jax, numpy as np
from minimax_jax.train.config import from_dict
from minimax_jax.train.data import SyntheticIterator
from minimax_jax.train.loop import Trainer
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from tests.train_helpers import MICRO_MSA_MODEL, micro_train_dict

assert jax.device_count() == 8, jax.devices()
out = {}
for mesh in json.loads(sys.argv[1]):
    tc = from_dict(micro_train_dict("unused", model=MICRO_MSA_MODEL, mesh=mesh,
                                    data={"kind": "synthetic", "seq_len": 48, "batch_size": 8},
                                    optim={"router_bias_rate": 0.01, "mtp_weights": 0.5},
                                    msa={"kl_coeff": 0.5}))
    clear_implementation_report()
    tr = Trainer(tc)
    assert tr.mesh.devices.size == (1 if mesh == "data=1" else 8)
    state = tr.initial_state()
    it = SyntheticIterator(48, 8, tr.cfg.vocab_size, seed=0, mean_doc_len=20)
    losses = []
    for s in range(3):
        state, m = tr.run_step(tr.phase_of(s), state, next(it))
        losses.append({k: float(v) for k, v in m.items()})
    leaves = [np.asarray(x).astype(np.float64) for x in jax.tree.leaves(jax.device_get(state["params"]))]
    out[mesh] = {"metrics": losses, "checksums": [float(x.sum()) for x in leaves],
                 "abs": [float(np.abs(x).sum()) for x in leaves], "impl": implementation_report()}
print("RESULT" + json.dumps(out))
"""


def _run(tmp_path, meshes):
    """The worker's results for ``meshes`` (the first one ``data=1``, the one-device reference)."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(meshes)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=subprocess_env(str(tmp_path / "cache"), devices=8))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def _compare(res, meshes):
    """Every mesh of ``meshes[1:]`` gave the losses and parameters of ``data=1`` (``res`` from ``_run``)."""
    ref = res["data=1"]
    for mesh in meshes[1:]:
        got = res[mesh]
        for step, (a, b) in enumerate(zip(ref["metrics"], got["metrics"])):
            for key in ("loss", "lm_loss", "mtp_loss/1", "indexer_kl", "grad_norm", "moe/max_load_ratio"):
                np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-7, err_msg=f"{mesh} step {step} {key}")
        np.testing.assert_allclose(got["checksums"], ref["checksums"], rtol=1e-4, atol=1e-4, err_msg=mesh)
        np.testing.assert_allclose(got["abs"], ref["abs"], rtol=1e-5, err_msg=mesh)
    assert ref["metrics"][2]["loss"] != ref["metrics"][0]["loss"]
    return res


def _check(tmp_path, meshes):
    return _compare(_run(tmp_path, meshes), meshes)


@pytest.fixture(scope="module")
def default_meshes(tmp_path_factory):
    """One worker run for the default run's two tests: the one-device reference, data=8 and sequence=4 x data=2
    (one subprocess, one reference compile)."""
    return _run(tmp_path_factory.mktemp("sharding"), ["data=1", "data=8", "sequence=4,data=2"])


def test_eight_devices_data_parallel_equals_one(default_meshes):
    _compare(default_meshes, ["data=1", "data=8"])


def test_context_parallel_train_py_equals_one_device(default_meshes):
    """train.py's Trainer with a sequence axis: attention and MSA run context-parallel in shard_map."""
    res = _compare(default_meshes, ["data=1", "sequence=4,data=2"])
    impl = res["sequence=4,data=2"]["impl"]
    assert impl.get("context_parallel/msa", "").startswith("sequence=4,"), impl
    assert impl.get("context_parallel/attention", "").startswith("sequence=4,"), impl
    assert not any(k.startswith("context_parallel") for k in res["data=1"]["impl"])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "data=4,expert=2", "fsdp=2,tensor=2,expert=2"])
def test_eight_devices_model_parallel_equals_one(tmp_path, mesh):
    _check(tmp_path, ["data=1", mesh])
