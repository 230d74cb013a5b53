"""The decode engine on a mesh (``minimax_jax.decode.mesh_attention``), 8 simulated CPU devices: context-parallel
chunked prefill (a chunk's tokens over the ``sequence`` axis) and kv heads over ``tensor`` (the paged cache
sharded by kv head).

A subprocess (``--xla_force_host_platform_device_count=8``) runs the same engine work once without a mesh
and once per mesh: a 300-token prompt in 64-token chunks (five chunks over a growing cached prefix), then
two prompts in one chunk step (one sharing 200 tokens with the first: a prefix-cache hit), then three
greedy decode steps of both, then a prompt (one chunk) whose last position's logits alone are computed. Every prompt
position's logits and every decode logit must equal the single-device run (fp32, 1e-5). Spies on the step's
prefill attention ops check that every call traced T / n local queries (a whole-chunk call sneaking back
fails); every device's shard of the K cache holds G / tensor kv heads; the jaxpr has no Pallas kernel
outside shard_map when the interpreted GPU kernels run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.paths import REPO_ROOT

TOL = 1e-5
CHUNK = 64


def _run_worker(model: str, meshes: list[str], impl: str, timeout: int = 900) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), model, ";".join(meshes), impl], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _axis(mesh: str, name: str) -> int:
    return int(dict(kv.split("=") for kv in mesh.split(",")).get(name, 1))


def _check(results: list[dict], meshes: list[str], msa: bool, kernels: bool, kv_heads: int = 2):
    assert [r["mesh"] for r in results] == meshes
    for r in results:
        seq, tp = _axis(r["mesh"], "sequence"), _axis(r["mesh"], "tensor")
        assert r["max_abs_err"] <= TOL and r["compared"] > 0, r
        order = "-" if seq == 1 else ("zigzag" if CHUNK % (2 * seq) == 0 else "natural")
        assert r["mesh_attention"] == f"sequence={seq},heads={'tensor' if tp > 1 else '-'},order={order}", r
        assert r["k_shard_heads"] == kv_heads // tp, r          # the paged cache is sharded by kv head
        assert r["decode"] == ("sequence=1,heads=tensor,order=-" if tp > 1 else None), r
        local = CHUNK // seq
        kinds = {"msa", "dense"} if msa else {"dense"}
        assert {tuple(c) for c in r["calls"]} == {(k, local) for k in kinds}, r
        if kernels:
            assert r["pallas_inside"] > 0 and r["pallas_outside"] == 0, r


@pytest.mark.parametrize("meshes", [
    ["sequence=2,tensor=2,fsdp=2"],
    pytest.param(["sequence=4,data=2", "tensor=2,data=4"], marks=pytest.mark.slow, id="seq4_and_heads_only")],
    ids=lambda m: "+".join(m))
def test_m3_prefill_sequence_parallel_equals_one_device(meshes):
    """Tiny M3 (a dense first layer and MSA layers) with the interpreted GPU kernels (MSA selection and
    sparse attention, the suffix-attention kernel for the dense layer): sequence=2 x tensor=2 x fsdp=2
    (zig-zag order: 2n divides the 64-token chunk; kv heads over tensor); slow (two more meshes of
    interpreted kernels): sequence=4 x data=2 and tensor=2 x data=4 (heads only: the decode steps and the whole chunk per
    head group)."""
    _check(_run_worker("configs/tiny-m3.yaml", meshes, "pallas_gpu_interpret"), meshes, msa=True, kernels=True)


@pytest.mark.slow
def test_m3_prefill_eight_way_sequence_parallel():
    """As above on sequence=8 (8 zig-zag pieces of 8 tokens per 64-token chunk); slow: ~40 s of interpreted
    kernels for a split the 4-way case already exercises."""
    meshes = ["sequence=8"]
    _check(_run_worker("configs/tiny-m3.yaml", meshes, "pallas_gpu_interpret"), meshes, msa=True, kernels=True)


@pytest.mark.slow
def test_m2_prefill_sequence_parallel_with_expert_axis():
    meshes = ["sequence=2,expert=2,data=2", "sequence=4,data=2", "tensor=2,expert=2,data=2"]
    _check(_run_worker("configs/tiny-m2.yaml", meshes, "xla"), meshes, msa=False, kernels=False)


def test_no_plan_without_a_mesh():
    """Outside ``use_mesh`` the step runs as before (the mesh cases are checked in the worker)."""
    from minimax_jax.config import ModelConfig
    from minimax_jax.decode import mesh_attention

    cfg = ModelConfig.from_yaml(os.path.join(REPO_ROOT, "configs/tiny-m3.yaml"))
    assert mesh_attention.plan(cfg, 2, 64, "gather") is None and mesh_attention.order(None) is None


# ----------------------------------------------------------------------------- worker
def _worker(model: str, meshes: list[str], impl: str) -> None:
    import jax

    from minimax_jax import sharding as sh
    from minimax_jax.config import ModelConfig
    from minimax_jax.decode import step as step_mod
    from minimax_jax.decode.engine import DecodeEngine
    from minimax_jax.model.params import init_params
    from minimax_jax.ops.registry import clear_implementation_report, implementation_report
    from tests.sharding.test_context_parallel import _pallas_calls

    seen: list[tuple] = []
    orig_msa, orig_prefill = step_mod.msa_ops.msa_attention, step_mod.prefill_attention

    class _MsaOps:                                   # the step's view of minimax_jax.ops.msa, with a spy
        def __getattr__(self, name):
            return getattr(orig_ops, name)

        @staticmethod
        def msa_attention(q, *a, **kw):
            seen.append(("msa", int(q.shape[1])))
            return orig_msa(q, *a, **kw)

    def prefill_spy(q, *a, **kw):
        seen.append(("dense", int(q.shape[1])))
        return orig_prefill(q, *a, **kw)

    orig_ops = step_mod.msa_ops
    step_mod.msa_ops, step_mod.prefill_attention = _MsaOps(), prefill_spy

    cfg = ModelConfig.from_yaml(os.path.join(REPO_ROOT, model)).replace(initializer_range=0.1, dtype="float32")
    if cfg.has_msa:     # tiny M3's dense layer and one MSA layer (of three alike): half the compile time
        cfg = cfg.replace(num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "moe"))
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    p1 = rng.integers(3, cfg.vocab_size, 300).tolist()
    p2 = p1[:200] + rng.integers(3, cfg.vocab_size, 90).tolist()
    p3 = rng.integers(3, cfg.vocab_size, 40).tolist()
    p4 = rng.integers(3, cfg.vocab_size, 60).tolist()    # one chunk: one compiled logit-rows step

    def run(mesh_spec):
        eng = DecodeEngine(params, cfg, max_seqs=3, max_len=512, prefill_chunk=CHUNK, implementation="xla",
                           prefill_implementation=impl)
        ctx = contextlib.nullcontext() if mesh_spec is None else sh.use_mesh(sh.make_mesh(mesh_spec),
                                                                             sh.load_rules("default"))
        with ctx:
            _, (l1,) = eng.prefill([p1], return_all_logits=True)
            slots, (l2, l3) = eng.prefill([p2, p3], return_all_logits=True)
            out = [l1, l2, l3]
            nxt = np.array([[int(np.argmax(l2[-1]))], [int(np.argmax(l3[-1]))]])
            for _ in range(3):
                lg = eng.decode_step(nxt, slots)
                out.append(lg)
                nxt = np.argmax(lg[:, -1:], axis=-1)
            eng.free(slots[1])
            _, (l4,) = eng.prefill([p4])           # only the last position's logits (the step's logit_rows)
            out.append(l4)
            jaxpr = None
            if mesh_spec is not None:                  # one prefill chunk's jaxpr, as the engine traces it
                tok = np.zeros((eng.max_seqs, CHUNK), np.int32)
                pos = np.full((eng.max_seqs, CHUNK), -1, np.int32)
                pos[0] = np.arange(CHUNK)
                jaxpr = jax.make_jaxpr(lambda c: step_mod.model_step.__wrapped__(
                    eng.params, c, tok, pos, eng.tables, cfg=cfg, spec=eng.spec, path="gather",
                    implementation=impl))(eng.cache)
        k0 = eng.cache[0]["k"]
        heads = {int(sh.data.shape[0]) for sh in k0.addressable_shards}
        return out, eng.seqs[slots[0]].cached_tokens, jaxpr, heads

    from minimax_jax.decode import mesh_attention as ma
    with sh.use_mesh(sh.make_mesh("sequence=8"), sh.load_rules("default")):   # which steps get a plan
        assert ma.plan(cfg, 3, 60, "gather") is None, "60 tokens do not split over 8 devices"
        assert ma.plan(cfg, 3, 64, "paged") is None, "decode steps are not split over tokens"
        p = ma.plan(cfg, 3, 64, "gather")
        assert p is not None and p.size == 8 and p.batch == () and p.heads == (), p
        assert ma.order(p) is not None and ma.order(ma.plan(cfg, 3, 8, "gather")) is None
    with sh.use_mesh(sh.make_mesh("tensor=2,sequence=4"), sh.load_rules("default")):
        p = ma.plan(cfg, 3, 8, "paged")
        assert p is not None and p.seq == () and p.heads == ("tensor",), p
    ref, cached, _, _ = run(None)
    assert cached > 0, "the second prompt should hit the prefix cache"
    for mesh_spec in meshes:
        clear_implementation_report()
        seen.clear()
        got, _, jaxpr, heads = run(mesh_spec)
        assert len(heads) == 1, heads
        errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(ref, got)]
        print(json.dumps({"mesh": mesh_spec, "max_abs_err": max(errs), "compared": sum(int(np.size(a)) for a in ref),
                          "mesh_attention": implementation_report().get("mesh_attention/gather"),
                          "decode": implementation_report().get("mesh_attention/paged"),
                          "k_shard_heads": heads.pop(),
                          "calls": sorted(set(seen)), **_pallas_calls(jaxpr)}), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2].split(";"), sys.argv[3])
