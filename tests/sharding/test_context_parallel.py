"""Context parallelism (``minimax_jax.ops.context_parallel``) on 8 simulated CPU devices.

A subprocess (``--xla_force_host_platform_device_count=8``) computes the training loss (LM + MTP + the
sparse indexer KL for MSA models) and every parameter gradient of a tiny model on packed rows (three
documents per row, positions restarting) once without a mesh and once per mesh with a ``sequence`` axis,
and compares every element (fp32, 1e-5). It also checks that every attention call of the sharded step
(the model's ``attention`` / ``msa_block``, spied on while tracing) sees the local query length T / n
(the decoder layers in zig-zag token order),
and that the jaxpr has no Pallas kernel (the MSA kernels, run in interpret mode) outside shard_map: a
full-length call sneaking back fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

TOL = 1e-5


def _run_worker(model: str, meshes: list[str], msa_impl: str = "xla", timeout: int = 900,
                attention_impl: str = "auto") -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), model, ";".join(meshes), msa_impl,
                           attention_impl], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _check(results: list[dict], meshes: list[str], msa: bool, kernels: bool = False):
    assert [r["mesh"] for r in results] == meshes
    for r in results:
        seq = int(dict(kv.split("=") for kv in r["mesh"].split(","))["sequence"])
        assert r["max_abs_err"] <= TOL and r["bad_leaves"] == [], r
        assert r["cp"].get("context_parallel/attention", "").startswith(f"sequence={seq},"), r
        if msa:
            assert r["cp"].get("context_parallel/msa", "").startswith(f"sequence={seq},"), r
            assert r["kl"] > 0, r                                    # the KL term is in the compared loss
            assert r["pallas_inside"] > 0 or not kernels, r           # the MSA kernels ran, inside shard_map
        # every attention call of the step traced with T / seq local queries: the decoder layers' in
        # zig-zag order (load balance), the MTP layers' in natural order; no kernel ran on the whole row
        # outside shard_map
        local = r["tokens"] // seq
        calls = {tuple(c[:3]) for c in r["calls"]}
        assert {c[1] for c in calls} == {local}, r
        assert ("attention", local, True) in calls and (("msa", local, True) in calls or not msa), r
        assert any(not c[2] for c in calls) == (r["mtp"] > 0), r
        assert r["pallas_outside"] == 0, r


def _m3_kernels(meshes: list[str]) -> list[dict]:
    return _run_worker("configs/tiny-m3.yaml", meshes, msa_impl="pallas_gpu_interpret",
                       attention_impl="pallas_masked_gpu_interpret")


# The default run's meshes of the two tests below: one worker computes both (one start-up, one compile of the
# one-device reference, which the two tests share: same model, batch and kernels).
SEQ_MESH, ROWS_MESH = "sequence=2,tensor=2,fsdp=2", "data=2,expert=2,tensor=2"


@pytest.fixture(scope="module")
def default_meshes() -> dict[str, dict]:
    return {r["mesh"]: r for r in _m3_kernels([SEQ_MESH, ROWS_MESH])}


def _m3_kernel_results(meshes: list[str], request) -> list[dict]:
    """The worker's results for ``meshes``: the default run's mesh from the shared worker, others (slow) alone."""
    if meshes in ([SEQ_MESH], [ROWS_MESH]):
        return [request.getfixturevalue("default_meshes")[meshes[0]]]
    return _m3_kernels(meshes)


@pytest.mark.parametrize("meshes", [[SEQ_MESH],
                                    pytest.param(["sequence=4,data=2"], marks=pytest.mark.slow, id="seq4")],
                         ids=lambda m: "+".join(m))
def test_m3_msa_kernels_sequence_parallel_equal_one_device(meshes, request):
    """Tiny M3 (dense first layer and MTP layer with the interpreted masked GPU kernel: local queries
    against the gathered keys; MSA layers with the interpreted GPU kernels, sparse KL): sequence=2 with
    tensor and fsdp; slow: sequence=4 (x data=2)."""
    results = _m3_kernel_results(meshes, request)
    _check(results, meshes, msa=True, kernels=True)
    assert all(r["attention_ran"] == "pallas_masked_gpu_interpret" for r in results), results


# mesh -> (rows per device, the heads' mesh axes) for the test below
_LOCAL_ROWS_CASES = {"data=2,tensor=4": (2, "-"), "data=2,expert=2,tensor=2": (1, "('tensor',)"),
                     "data=4,tensor=2": (1, "('tensor',)")}


@pytest.mark.parametrize("meshes", [
    [ROWS_MESH],
    pytest.param(["data=2,tensor=4", "data=4,tensor=2"], marks=pytest.mark.slow, id="data2_tensor4+data4_tensor2")],
    ids=lambda m: "+".join(m))
def test_kernels_run_on_local_rows_without_a_sequence_axis(meshes, request):
    """Data / fsdp / expert / tensor meshes without a ``sequence`` axis: the attention and MSA kernels still run
    in shard_map on each device's rows (and heads), never on the global batch (a Pallas kernel or cuDNN call
    left to GSPMD makes every device gather the whole batch and run the whole kernel), and the loss and every
    gradient equal one device's. Tiny M3 with the interpreted GPU kernels on data=2 x expert=2 x tensor=2 (one
    row and one kv head per device); slow: data=2 x tensor=4 (heads unsplit: two kv heads do not split 4 ways; two
    rows per device, as tests/sharding/test_tree_rows_mesh.py's data=2 x tensor=2 with the MSA kernels) and
    data=4 x tensor=2."""
    results = _m3_kernel_results(meshes, request)
    assert [r["mesh"] for r in results] == meshes
    for r in results:
        local_rows, heads = _LOCAL_ROWS_CASES[r["mesh"]]
        assert r["max_abs_err"] <= TOL and r["bad_leaves"] == [], r
        for name in ("attention", "msa"):
            assert r["cp"][f"context_parallel/{name}"].startswith("sequence=1,"), r
            assert f"heads={heads}," in r["cp"][f"context_parallel/{name}"], r
        assert {(c[1], c[3]) for c in r["calls"]} == {(r["tokens"], local_rows)}, r     # full rows, local batch
        assert r["pallas_inside"] > 0 and r["pallas_outside"] == 0, r
        assert r["kl"] > 0, r


@pytest.mark.slow
def test_m2_dense_sequence_parallel_with_expert_axis():
    meshes = ["sequence=8", "sequence=2,expert=2,data=2"]
    _check(_run_worker("configs/tiny-m2.yaml", meshes), meshes, msa=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["configs/tiny-m2.yaml", "configs/tiny-m3.yaml"])
def test_full_matrix(model):
    meshes = ["sequence=2,data=4", "sequence=4,data=2", "sequence=8", "sequence=2,tensor=4", "sequence=4,fsdp=2",
              "sequence=2,expert=2,tensor=2"]
    _check(_run_worker(model, meshes, timeout=1800), meshes, msa="m3" in model)


# ----------------------------------------------------------------------------- worker
def _pallas_calls(closed) -> dict:
    """pallas_calls inside and outside shard_map bodies in a jaxpr (recursively)."""
    out = {"pallas_inside": 0, "pallas_outside": 0}

    def subjaxprs(v):
        if isinstance(v, (tuple, list)):
            for x in v:
                yield from subjaxprs(x)
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            yield v.jaxpr
        elif hasattr(v, "eqns"):
            yield v

    def walk(jx, inside):
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name == "pallas_call":
                out["pallas_inside" if inside else "pallas_outside"] += 1
            for sub in subjaxprs(list(eqn.params.values())):
                walk(sub, inside or name == "shard_map")

    walk(closed.jaxpr, False)
    return out


def _worker(model: str, meshes: list[str], msa_impl: str, attention_impl: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax import sharding as sh
    from minimax_jax.config import ModelConfig
    from minimax_jax.model import params_shardings
    from minimax_jax.model.params import init_params
    from minimax_jax.ops.registry import clear_implementation_report, implementation_report
    from minimax_jax.model import transformer
    from minimax_jax.ops import context_parallel
    from minimax_jax.train.step import StepSpec, _loss_fn, batch_norms

    # Spies on the model's attention calls: the query length each one traces with (local inside shard_map).
    seen: list[list] = []
    orig_attention, orig_msa = transformer.attention, transformer.msa_block

    def attention_spy(q, *a, **kw):
        seen.append(["attention", int(q.shape[1]), context_parallel.current_order() is not None, int(q.shape[0])])
        return orig_attention(q, *a, **kw)

    def msa_spy(q, *a, **kw):
        seen.append(["msa", int(q.shape[1]), context_parallel.current_order() is not None, int(q.shape[0])])
        return orig_msa(q, *a, **kw)

    transformer.attention, transformer.msa_block = attention_spy, msa_spy

    cfg = ModelConfig.from_yaml(os.path.join(REPO_ROOT, model)).replace(initializer_range=0.1, msa_impl=msa_impl,
                                                                        attention_impl=attention_impl)
    if cfg.has_msa:     # tiny M3's dense layer and one MSA layer (of three alike; both MTP modules): less to compile
        cfg = cfg.replace(num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "moe"))
    params = init_params(cfg, jax.random.key(1))
    b, t = 4, (128 if cfg.has_msa else 64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (b, t)).astype(np.int32)
    cuts = [0, t // 3 + 5, 2 * t // 3 - 3, t]                     # three packed documents per row
    seg = np.concatenate([np.full(cuts[i + 1] - cuts[i], i + 1) for i in range(3)]).astype(np.int32)
    pos = np.concatenate([np.arange(cuts[i + 1] - cuts[i]) for i in range(3)]).astype(np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, 1), "positions": np.tile(pos, (b, 1)),
             "segment_ids": np.tile(seg, (b, 1)), "loss_mask": np.ones((b, t), np.float32)}
    batch["loss_mask"][:, -1] = 0
    spec = StepSpec(cfg=cfg, kl_mode="sparse" if cfg.has_msa else None, remat="none", logits_chunk=0,
                    mtp_weights=(0.3,) * cfg.num_mtp_modules)
    step = jax.value_and_grad(_loss_fn(spec, jax.tree.map(lambda _: True, params)), has_aux=True)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    norms = batch_norms(jb, cfg.num_mtp_modules)
    (ref_loss, ref_m), ref_grads = jax.jit(step)(params, jb, norms)
    ref = {"loss": ref_loss, "grads": ref_grads}
    for mesh_spec in meshes:
        mesh = sh.make_mesh(mesh_spec)
        rules = sh.load_rules("default")
        p = jax.device_put(params, params_shardings(cfg, mesh, rules))
        gb = {k: jax.device_put(v, sh.batch_sharding(mesh, rules)) for k, v in jb.items()}
        clear_implementation_report()
        seen.clear()
        with sh.use_mesh(mesh, rules):
            (loss, m), grads = jax.jit(step)(p, gb, norms)
            jaxpr = jax.make_jaxpr(step)(p, gb, norms)
        report = implementation_report()
        calls = dict(_pallas_calls(jaxpr), calls=sorted({tuple(c) for c in seen}))
        got = {"loss": loss, "grads": grads}
        errs = jax.tree.map(lambda a, c: float(np.max(np.abs(np.asarray(a) - np.asarray(c)))) if np.size(a) else 0.0,
                            ref, got)
        flat, _ = jax.tree_util.tree_flatten_with_path(errs)
        bad = [jax.tree_util.keystr(k) for k, v in flat if not v <= TOL]
        print(json.dumps({"mesh": mesh_spec, "max_abs_err": max(v for _, v in flat), "bad_leaves": bad,
                          "cp": {k: v for k, v in report.items() if k.startswith("context_parallel")},
                          "kl": float(m.get("indexer_kl", 0.0)), "tokens": t, "rows": b,
                          "attention_ran": report.get("attention"),
                          "mtp": cfg.num_mtp_modules, **calls}), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2].split(";"), sys.argv[3], sys.argv[4])


def test_zigzag_order_balances_causal_work():
    import numpy as np

    from minimax_jax.ops.context_parallel import zigzag

    for t, n in [(64, 2), (128, 4), (4096, 8)]:
        perm = zigzag(t, n)
        assert perm.dtype == np.int32 and sorted(perm.tolist()) == list(range(t))
        causal = lambda order: (order + 1).reshape(n, -1).sum(1)       # noqa: E731  (keys seen per shard)
        assert causal(perm).max() == causal(perm).min()
        natural = causal(np.arange(t))
        assert natural.max() > 2 * natural.min()                       # contiguous shards: far apart
    with pytest.raises(ValueError, match="do not split"):
        zigzag(40, 8)
