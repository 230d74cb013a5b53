"""Expert-parallel MoE under shard_map's varying-manual-axes typing ("vma", ``check_vma=True``).

Regression for a GPU failure of bench/moe.py (jax 0.11.2): "Custom VJP
bwd rule attached to unpermute_combine ... produced an output of type bfloat16[8192,1024]{V:expert}
corresponding to an input of type bfloat16[8192,1024]". Since jax 0.10 the varying axes are read
from ``jax.typeof(x).manual_axis_type.varying`` (``.vma`` was removed), so ``match_vma`` silently
did nothing and two values reached ``unpermute_combine`` typed invariant over ``expert`` while its
output cotangent varied: the fresh receive buffer of ``ragged_all_to_all`` (whose output takes
the buffer's type) and a kernel output that does not propagate the type.

Runs this file as a subprocess with 2 simulated CPU devices. Cases:
- ``kernel_drops_vma``: mesh ``data=2`` (an expert axis of size 1, as on one GPU), the expert MLP
  (``expert_parallel.sorted_expert_mlp``, i.e. the grouped-matmul kernels) wrapped by a test-only ``psum`` over
  the size-1 ``expert`` axis: the same values, typed invariant over ``expert`` like the output of a
  kernel that does not propagate the type. Forward and gradients == the dense MoE.
- ``ragged_buffer_trace``: the failing GPU path itself, ``ragged_all_to_all`` over ``expert=2``. That
  collective does not run on CPU, so the GPU backend is assumed (``assume_backend``) and forward + gradient
  are only traced (which is where the error was raised).
- ``gpu_auto_transport``: GPU backend assumed, transport ``"auto"`` over ``expert=2`` picks the
  padded ``all_to_all``; forward and gradients == the dense MoE.
The Pallas kernels in interpret mode (``pallas_gpu_interpret``) cannot run here: JAX's Pallas HLO
interpreter fails its own vma check inside ``shard_map`` (``dynamic_slice requires varying manual
axes to match``, jax 0.10.2), independent of this code.
"""

from __future__ import annotations
from tests.paths import REPO_ROOT

import json
import os
import subprocess
import sys

ROOT = REPO_ROOT
CASES = [  # (name, mesh, moe implementation, transport, expected record)
    ("kernel_drops_vma", "data=2", "xla_ragged", "auto", "expert_parallel[none,xla,ep=1,tp=1]"),
    ("ragged_buffer_trace", "expert=2", "xla_ragged", "ragged_all_to_all",
     "expert_parallel[ragged_all_to_all,xla,ep=2,tp=1]"),
    # transport "auto" on a GPU backend is the padded all_to_all (measured far faster than
    # ragged_all_to_all on two GPUs, BENCHMARKS.md (MoE)); it runs here, so values are compared
    ("gpu_auto_transport", "expert=2", "xla_ragged", "auto", "expert_parallel[all_to_all,xla,ep=2,tp=1]"),
]


def test_expert_parallel_vma_typing():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (rows, proc.stderr[-8000:])
    assert [r["case"] for r in rows] == [c[0] for c in CASES], rows
    for case, row in zip(CASES, rows):
        assert row.get("error") is None, row
        assert row["moe"] == case[4], row
        if row["max_rel_err"] is not None:
            assert row["max_rel_err"] <= 1e-5, row


def _worker():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import contextlib

    from minimax_jax import sharding as sh
    from minimax_jax.ops import moe
    from minimax_jax.ops.moe import expert_parallel as expert_mod
    from minimax_jax.ops.registry import assume_backend, clear_implementation_report, implementation_report

    assert jax.device_count() == 2, jax.devices()

    def act(g):
        a, b = jnp.split(g, 2, axis=-1)
        return jax.nn.silu(a) * b

    real_mlp = expert_mod.sorted_expert_mlp

    def mlp_dropping_expert_vma(*args):
        # the "expert" axis has size 1 here: psum keeps the values and types the output invariant
        # over it, as a pallas_call / tokamax kernel that does not propagate the type would
        return jax.lax.psum(real_mlp(*args), "expert")

    h, k, e, width, n = 16, 2, 4, 8, 12
    ks = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(ks[0], (n, h))
    router = jax.random.normal(ks[1], (h, e))
    wi = 0.3 * jax.random.normal(ks[2], (e, h, 2 * width))
    wo = 0.3 * jax.random.normal(ks[3], (e, width, h))
    cot = jax.random.normal(ks[4], (n, h))

    def loss(x, router, wi, wo, impl, transport):
        w, ex, _ = moe.route(x, router, jnp.zeros((e,)), k)
        return jnp.sum(moe.moe_experts(x, w, ex, wi, wo, act, implementation=impl, ep_transport=transport) * cot)

    f = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    ref = jax.jit(f, static_argnums=(4, 5))(x, router, wi, wo, "xla_dense", "auto")
    for name, mesh_spec, impl, transport, _ in CASES:
        row = {"case": name, "moe": None, "max_rel_err": None, "error": None}
        clear_implementation_report()
        # the assumed backend and the patched expert MLP are not part of jit's cache key: without this
        # a case could reuse an earlier case's trace (and record nothing)
        jax.clear_caches()
        gpu = assume_backend("gpu") if name in ("ragged_buffer_trace", "gpu_auto_transport") else contextlib.nullcontext()
        try:
            with sh.use_mesh(sh.make_mesh(mesh_spec), sh.load_rules("default")), gpu:
                if name == "kernel_drops_vma":
                    expert_mod.sorted_expert_mlp = mlp_dropping_expert_vma
                if name == "ragged_buffer_trace":
                    jaxpr = jax.make_jaxpr(f, static_argnums=(4, 5))(x, router, wi, wo, impl, transport)
                    assert "ragged_all_to_all" in str(jaxpr)
                else:
                    got = jax.jit(f, static_argnums=(4, 5))(x, router, wi, wo, impl, transport)
                    row["max_rel_err"] = max(
                        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, float(np.max(np.abs(b)))))
                        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        except Exception as err:  # noqa: BLE001  (reported to the test, which shows it)
            row["error"] = f"{type(err).__name__}: {str(err)[:600]}"
        finally:
            expert_mod.sorted_expert_mlp = real_mlp
        row["moe"] = implementation_report().get("moe")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _worker()
