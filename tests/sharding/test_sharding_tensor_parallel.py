"""Tensor parallelism of attention on 8 simulated CPU devices (subprocess):

- M2's full-width q/k RMSNorm with q/k columns and norm weights split over ``tensor``: GSPMD
  reduces the variance across the shards (an all-reduce appears in the compiled HLO) and q/k/v
  equal the unsharded projection element by element;
- MSA index heads follow their kv groups: ``index_q_proj`` columns are split over ``tensor`` like
  ``k_proj``'s, so tensor shard r holds index head r and kv head r (specs checked), and the index
  q/k equal the unsharded ones.
"""

from __future__ import annotations
from tests.paths import REPO_ROOT

import json
import os
import subprocess
import sys

ROOT = REPO_ROOT


def test_tensor_parallel_attention_projections():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-8000:]
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["m2_qkv_err"] <= 1e-5, r
    assert r["m2_allreduce"], r
    assert r["m2_qnorm_spec"] == [None, "tensor"] and r["m2_qproj_spec"] == [None, "fsdp", "tensor"], r
    assert r["m3_index_err"] <= 1e-5, r
    assert r["m3_index_q_spec"] == r["m3_k_spec"] == [None, "fsdp", "tensor"], r
    assert r["m3_index_cols_per_shard"] == r["index_head_dim"], r
    assert r["m3_k_cols_per_shard"] == r["head_dim"], r


def _worker():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax import sharding as sh

    from minimax_jax.model import params_shardings
    from minimax_jax.config import ModelConfig
    from minimax_jax.model.layers import rope_frequencies
    from minimax_jax.model.params import init_params
    from minimax_jax.model.transformer import project_index, project_qkv

    out = {}
    rules = sh.load_rules()
    # ---- M2: full-width q/k norm, tensor=2 (3 q heads and 1 kv head per shard), fsdp=4.
    cfg = ModelConfig.from_yaml(os.path.join(ROOT, "configs/tiny-m2.yaml")).replace(initializer_range=0.2)
    mesh = sh.make_mesh("fsdp=4,tensor=2")
    params = init_params(cfg, jax.random.key(0))
    # Non-trivial norm weights so a wrong (per-shard) variance cannot hide.
    params["segments"][0]["attn"]["q_norm"]["scale"] = 1 + 0.3 * jax.random.normal(
        jax.random.key(5), params["segments"][0]["attn"]["q_norm"]["scale"].shape)
    shard = params_shardings(cfg, mesh, rules)
    x = jax.random.normal(jax.random.key(1), (4, 8, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(8), (4, 8))
    cos, sin = rope_frequencies(pos, cfg.rotary_dim, cfg.rope_theta)

    def qkv(seg, x):
        lp = jax.tree.map(lambda a: a[0], seg)
        return project_qkv(lp, x, cfg, cos, sin)

    ref = jax.jit(qkv)(params["segments"][0], x)
    seg = jax.device_put(params["segments"][0], shard["segments"][0])
    with sh.use_mesh(mesh, rules):
        f = jax.jit(qkv)
        got = f(seg, x)
        hlo = f.lower(seg, x).compile().as_text()
    out["m2_qkv_err"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(ref, got))
    out["m2_allreduce"] = "all-reduce" in hlo
    out["m2_qnorm_spec"] = list(seg["attn"]["q_norm"]["scale"].sharding.spec)
    out["m2_qproj_spec"] = list(seg["attn"]["q_proj"].sharding.spec)

    # ---- M3: MSA index heads with their kv groups, tensor=2 == num_kv_heads.
    cfg = ModelConfig.from_yaml(os.path.join(ROOT, "configs/tiny-m3.yaml")).replace(initializer_range=0.2)
    mesh = sh.make_mesh("fsdp=4,tensor=2")
    params = init_params(cfg, jax.random.key(2))
    shard = params_shardings(cfg, mesh, rules)
    si = next(i for i, s in enumerate(params["segments"]) if "index_q_proj" in s["attn"])
    x = jax.random.normal(jax.random.key(3), (4, 8, cfg.hidden_size))
    cos, sin = rope_frequencies(pos, cfg.rotary_dim, cfg.rope_theta)

    def index(seg, x):
        lp = jax.tree.map(lambda a: a[0], seg)
        return project_index(lp, x, cfg, cos, sin)

    ref = jax.jit(index)(params["segments"][si], x)
    seg = jax.device_put(params["segments"][si], shard["segments"][si])
    with sh.use_mesh(mesh, rules):
        got = jax.jit(index)(seg, x)
    out["m3_index_err"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(ref, got))
    iq, kp = seg["attn"]["index_q_proj"], seg["attn"]["k_proj"]
    out["m3_index_q_spec"] = list(iq.sharding.spec)
    out["m3_k_spec"] = list(kp.sharding.spec)
    out["m3_index_cols_per_shard"] = iq.addressable_shards[0].data.shape[-1]
    out["m3_k_cols_per_shard"] = kp.addressable_shards[0].data.shape[-1]
    out["index_head_dim"], out["head_dim"] = cfg.index_head_dim, cfg.head_dim
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _worker()
