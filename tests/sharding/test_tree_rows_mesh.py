"""Prefix-tree rows on a data-parallel mesh (4 simulated CPU devices): the attention and MSA layers run in
``shard_map`` on each device's rows (tree visibility needs a row's own keys, so rows split, tokens never), and
the merged batch's loss, indexer KL and every gradient equal one device's (fp32, 1e-5), for tree visibility in
the XLA ops (``subtree_end`` + ``input_weight``) and for the per-trajectory key layout through the interpreted
GPU kernels (no Pallas kernel outside shard_map: none runs on the global batch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

TOL = 1e-5


ROWS = {"data=4": 1, "data=2,tensor=2": 2}          # mesh -> rows per device


def _run_worker(groups: list[tuple[str, list[str]]]) -> list[dict]:
    """One worker process for ``groups`` of (way, meshes): its result lines (each naming its way and mesh)."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *(f"{w}:{';'.join(m)}" for w, m in groups)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-8000:])
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# The default run's cases: one worker process for both (one interpreter and JAX start-up).
DEFAULT_CASES = [("ops_xla", ["data=4", "data=2,tensor=2"]), ("keys_pallas", ["data=2,tensor=2"])]


@pytest.fixture(scope="module")
def default_cases() -> list[dict]:
    return _run_worker(DEFAULT_CASES)


@pytest.mark.parametrize("way,meshes", [
    *DEFAULT_CASES,
    pytest.param("keys_pallas", ["data=4"], marks=pytest.mark.slow, id="keys_pallas-data=4")],
    ids=lambda v: "+".join(v) if isinstance(v, list) else v)
def test_tree_rows_split_over_the_batch_axes_equal_one_device(way, meshes, request):
    """Both meshes with the XLA ops; the interpreted kernels (~20 s a mesh) on data=2 x tensor=2 (two rows per
    device), on data=4 (one row per device, as tests/sharding/test_context_parallel.py's local-rows case with
    the kernels) only in the slow run."""
    if (way, meshes) in DEFAULT_CASES:
        results = [r for r in request.getfixturevalue("default_cases") if r["way"] == way]
    else:
        results = _run_worker([(way, meshes)])
    assert [r["mesh"] for r in results] == meshes
    for r in results:
        rows = ROWS[r["mesh"]]
        assert r["max_abs_err"] <= TOL and r["bad_leaves"] == [] and r["kl"] > 0, r
        assert r["cp"]["context_parallel/msa"].startswith("sequence=1,batch=('data',),heads=-"), r
        assert r["cp"]["context_parallel/attention"].startswith("sequence=1,batch=('data',),heads=-"), r
        assert set(r["rows_seen"]) == {rows}, r                      # every attention call on local rows
        assert r["pallas_outside"] == 0, r
        assert r["pallas_inside"] > 0 or way == "ops_xla", r


def _worker(way: str, meshes: list[str]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax import sharding as sh
    from minimax_jax.config import ModelConfig
    from minimax_jax.data.prefix_tree import pack_trajectories
    from minimax_jax.model import init_params, params_shardings, transformer
    from minimax_jax.ops.registry import clear_implementation_report, implementation_report
    from minimax_jax.train.step import StepSpec, _loss_fn, batch_norms
    from tests.sharding.test_context_parallel import _pallas_calls
    from tests.train.test_prefix_tree_exact import _trajs, _tree

    seen: list[int] = []
    orig_attention, orig_msa = transformer.attention, transformer.msa_block

    def attention_spy(q, *a, **kw):
        seen.append(int(q.shape[0]))
        return orig_attention(q, *a, **kw)

    def msa_spy(q, *a, **kw):
        seen.append(int(q.shape[0]))
        return orig_msa(q, *a, **kw)

    transformer.attention, transformer.msa_block = attention_spy, msa_spy
    cfg = ModelConfig.from_yaml(os.path.join(REPO_ROOT, "configs/tiny-m3.yaml")).replace(
        vocab_size=97, num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "moe"), num_mtp_modules=0,
        msa_impl="pallas_gpu_interpret" if way == "keys_pallas" else "xla")
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(3)
    tokens = [t for spec in [(37, [(50, []), (45, [])]), (20, [(16, [(30, []), (9, [])]), (40, [])]),
                             (64, [(30, []), (12, [])]), (25, [(33, []), (11, [])])] for t in _tree(rng, spec)]
    packed, _ = pack_trajectories(_trajs(rng, tokens), 192, 4, key_len=None if way == "ops_xla" else 768)
    batch = {k: jnp.asarray(v) for k, v in packed.items()}
    spec = StepSpec(cfg=cfg, z_loss=1e-3, kl_mode="sparse", kl_coeff=0.5)
    step = jax.value_and_grad(_loss_fn(spec, jax.tree.map(lambda _: True, params)), has_aux=True)
    norms = batch_norms(batch, 0)
    ref = jax.jit(step)(params, batch, norms)
    for mesh_spec in meshes:
        mesh, rules = sh.make_mesh(mesh_spec), sh.load_rules("default")
        p = jax.device_put(params, params_shardings(cfg, mesh, rules))
        gb = {k: jax.device_put(v, sh.batch_sharding(mesh, rules)) for k, v in batch.items()}
        clear_implementation_report()
        seen.clear()
        with sh.use_mesh(mesh, rules):
            got = jax.jit(step)(p, gb, norms)
            jaxpr = jax.make_jaxpr(step)(p, gb, norms)
        report = implementation_report()
        (l_ref, m_ref), g_ref = ref
        (l_got, m_got), g_got = got
        errs = jax.tree.map(lambda a, c: float(np.max(np.abs(np.asarray(a) - np.asarray(c)))) if np.size(a) else 0.0,
                            {"loss": l_ref, "kl": m_ref["indexer_kl"], "grads": g_ref},
                            {"loss": l_got, "kl": m_got["indexer_kl"], "grads": g_got})
        flat, _ = jax.tree_util.tree_flatten_with_path(errs)
        print(json.dumps({"way": way, "mesh": mesh_spec, "max_abs_err": max(v for _, v in flat),
                          "bad_leaves": [jax.tree_util.keystr(k) for k, v in flat if not v <= TOL],
                          "kl": float(m_got["indexer_kl"]), "rows_seen": sorted(set(seen)),
                          "cp": {k: v for k, v in report.items() if k.startswith("context_parallel")},
                          **_pallas_calls(jaxpr)}), flush=True)


if __name__ == "__main__":      # arguments: WAY:MESH;MESH ... (one group after the other)
    for group in sys.argv[1:]:
        way, meshes = group.split(":", 1)
        _worker(way, meshes.split(";"))
