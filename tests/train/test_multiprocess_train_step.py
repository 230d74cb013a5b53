"""Two real processes on this machine (``jax.distributed`` over localhost, 2 CPU devices each) run
one sharded SGD step of the tiny M2 model and agree with the single-process step.

The test starts two subprocesses of this file (worker mode), each calling
``minimax_jax.distributed.initialize("localhost:PORT", 2, rank)``; they build the global mesh
``fsdp=2,expert=2`` from all 4 devices, place the same params/tokens as global arrays, run the
step inside ``use_mesh`` (the MoE runs expert-parallel across the two processes) and process 0
saves the gathered loss and updated params. The test compares them with the same step computed
in a third, single-device process, every element (fp32, 1e-5).
"""

from __future__ import annotations
from tests.paths import REPO_ROOT

import os
import socket
import subprocess
import sys

import numpy as np

ROOT = REPO_ROOT
LR = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_two_processes_agree_with_one(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "multi", str(port), str(r), str(tmp_path)],
                              env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    single = subprocess.run([sys.executable, os.path.abspath(__file__), "single", "0", "0", str(tmp_path)],
                            env=_env(1), cwd=ROOT, capture_output=True, text=True, timeout=600)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, f"rank failed:\n{o[-3000:]}\n{e[-6000:]}"
    assert single.returncode == 0, single.stderr[-6000:]
    multi = np.load(tmp_path / "multi.npz")
    ref = np.load(tmp_path / "single.npz")
    assert sorted(multi.files) == sorted(ref.files) and len(ref.files) > 10
    for name in ref.files:
        np.testing.assert_allclose(multi[name], ref[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert "expert_parallel[all_to_all" in outs[0][0] and "ep=2" in outs[0][0]
    assert "process_count=2 devices=4" in outs[1][0]


# ----------------------------------------------------------------------------- worker
def _worker(mode: str, port: int, rank: int, out_dir: str) -> None:
    if mode == "multi":
        from minimax_jax import distributed

        distributed.initialize(f"localhost:{port}", 2, rank)
    import jax
    import jax.numpy as jnp

    from minimax_jax import sharding as sh

    from minimax_jax.model import params_shardings
    from minimax_jax.config import ModelConfig
    from minimax_jax.model.params import init_params
    from minimax_jax.model.transformer import forward
    from minimax_jax.ops.registry import implementation_report

    cfg = ModelConfig.from_yaml(os.path.join(ROOT, "configs/tiny-m2.yaml")).replace(num_experts=4, initializer_range=0.1)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size, jnp.int32))

    def step(p, tok):
        def loss_fn(p):
            logp = jax.nn.log_softmax(forward(p, cfg, tok).logits[:, :-1], axis=-1)
            return -jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1).mean()

        loss, g = jax.value_and_grad(loss_fn)(p)
        return loss, jax.tree.map(lambda a, b: a - LR * b, p, g)

    if mode == "single":
        loss, new = jax.jit(step)(params, tokens)
    else:
        mesh = sh.make_mesh("fsdp=2,expert=2")
        rules = sh.load_rules()
        print(f"process_count={jax.process_count()} devices={len(jax.devices())}", flush=True)

        def put(a, s):
            return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

        p = jax.tree.map(put, params, params_shardings(cfg, mesh, rules))
        tok = put(tokens, sh.batch_sharding(mesh, rules))
        with sh.use_mesh(mesh, rules):
            loss, new = jax.jit(step, out_shardings=(sh.replicated(mesh), sh.replicated(mesh)))(p, tok)
        print(implementation_report().get("moe"), flush=True)
        if rank != 0:
            return
    flat, _ = jax.tree_util.tree_flatten_with_path(new)
    arrays = {jax.tree_util.keystr(k): np.asarray(jax.device_get(v)) for k, v in flat}
    arrays["loss"] = np.asarray(jax.device_get(loss))
    np.savez(os.path.join(out_dir, f"{mode}.npz"), **arrays)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
