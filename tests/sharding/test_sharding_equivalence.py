"""Sharded forward and gradients equal the unsharded ones (fp32) on 8 simulated CPU devices.

Each test starts a subprocess with ``--xla_force_host_platform_device_count=8`` added to
``XLA_FLAGS`` (the flag must be set before JAX starts, and the rest of the suite must keep one
device), which runs this file as a script: it computes the loss, logits and parameter gradients of a tiny model once
without a mesh and once per mesh (params placed with ``minimax_jax.model.params_shardings``, tokens with
``batch_sharding``, traced inside ``use_mesh`` so the MoE runs expert-parallel in shard_map), and
compares every element. The script prints one JSON line per mesh; the test checks them.
The full matrix (M2 and M3 tiny, four meshes) is marked ``slow`` (run with ``-m slow``).
"""

from __future__ import annotations
from tests.paths import REPO_ROOT

import json
import os
import subprocess
import sys

import pytest

ROOT = REPO_ROOT
MESHES = ["data=8", "fsdp=2,tensor=4", "expert=4,data=2", "fsdp=2,expert=2,tensor=2"]
TOL = 1e-5


def _run_worker(model: str, meshes: list[str], timeout: int = 600) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), model, ";".join(meshes)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(results: list[dict], meshes: list[str]):
    assert [r["mesh"] for r in results] == meshes
    for r in results:
        assert r["devices"] == 8
        assert r["max_abs_err"] <= TOL, r
        assert r["bad_leaves"] == [], r
        # The MoE ran expert-parallel in shard_map with the mesh's expert axis.
        ep = dict(kv.split("=") for kv in r["mesh"].split(",")).get("expert", "1")
        assert r["moe"].startswith("expert_parallel[") and f"ep={ep}," in r["moe"], r
        assert r["sharded_leaves"] > 0 or r["mesh"] == "data=8", r


def test_m2_all_axes_mesh_equals_unsharded():
    """Fast default: one mesh that uses fsdp, expert and tensor at once (EP + TP + FSDP)."""
    _check(_run_worker("configs/tiny-m2.yaml", ["fsdp=2,expert=2,tensor=2"]), ["fsdp=2,expert=2,tensor=2"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["configs/tiny-m2.yaml", "configs/tiny-m3.yaml"])
def test_all_meshes_equal_unsharded(model):
    """The full matrix (about 1-2 CPU-minutes per model): data=8; fsdp=2 x tensor=4;
    expert=4 x data=2; fsdp=2 x expert=2 x tensor=2."""
    _check(_run_worker(model, MESHES, timeout=1800), MESHES)


# ----------------------------------------------------------------------------- worker
def _worker(model: str, meshes: list[str]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax import sharding as sh

    from minimax_jax.model import params_shardings
    from minimax_jax.config import ModelConfig
    from minimax_jax.model.params import init_params
    from minimax_jax.model.transformer import forward
    from minimax_jax.ops.registry import clear_implementation_report, implementation_report

    cfg = ModelConfig.from_yaml(os.path.join(ROOT, model)).replace(initializer_range=0.1)
    params = init_params(cfg, jax.random.key(1))
    # A non-zero router bias so the selection-only bias matters.
    params["segments"] = [
        {**s, "mlp": {**s["mlp"], "router_bias": 0.05 * jax.random.normal(jax.random.key(2 + i), s["mlp"]["router_bias"].shape)}}
        if "router_bias" in s["mlp"] else s for i, s in enumerate(params["segments"])]
    b, t = 8, (128 if cfg.has_msa else 32)
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, cfg.vocab_size, jnp.int32)

    def loss_fn(p, tok):
        out = forward(p, cfg, tok)
        logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1).mean()
        return nll, (out.logits, out.aux["router_load"])

    step = jax.value_and_grad(loss_fn, has_aux=True)
    (ref_loss, (ref_logits, ref_load)), ref_grads = jax.jit(step)(params, tokens)
    ref = {"loss": ref_loss, "logits": ref_logits, "load": ref_load, "grads": ref_grads}
    for spec in meshes:
        mesh = sh.make_mesh(spec)
        rules = sh.load_rules("default")
        shardings = params_shardings(cfg, mesh, rules)
        p = jax.device_put(params, shardings)
        tok = jax.device_put(tokens, sh.batch_sharding(mesh, rules))
        clear_implementation_report()
        with sh.use_mesh(mesh, rules):
            (loss, (logits, load)), grads = jax.jit(step)(p, tok)
        got = {"loss": loss, "logits": logits, "load": load, "grads": grads}
        errs = jax.tree.map(lambda a, c: float(np.max(np.abs(np.asarray(a) - np.asarray(c)))) if np.size(a) else 0.0,
                            ref, got)
        flat, _ = jax.tree_util.tree_flatten_with_path(errs)
        bad = [jax.tree_util.keystr(k) for k, v in flat if not v <= TOL]
        sharded = sum(1 for s in jax.tree.leaves(shardings) if any(a is not None for a in s.spec))
        print(json.dumps({"mesh": spec, "devices": len(mesh.devices.flat), "max_abs_err": max(v for _, v in flat),
                          "bad_leaves": bad, "moe": implementation_report().get("moe", ""),
                          "sharded_leaves": sharded}), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2].split(";"))
