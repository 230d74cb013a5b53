"""Per-device memory of one M3-shaped MSA layer's forward + backward with context parallelism: XLA's
buffer plan (``compiled.memory_analysis()``), nothing runs.

Usage (CPU; the device count must be set before JAX starts)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python bench/cp_memory.py --tokens 1048576 --sequence 1,8

One layer's attention (``msa_block``: selection, sparse attention, sparse indexer KL; M3 shapes: 64 q heads,
4 kv heads, D = Di = 128, block 128, top-16, bf16), the gradient of a scalar of its output and KL with
respect to q, k, v, qi, ki, compiled once without a mesh (sequence=1) and once per ``--sequence`` n on a
mesh ``sequence=n,data=8/n`` (context parallelism, ``minimax_jax.ops.context_parallel``, zig-zag order
not applied: one layer). ``--impl``: the MSA implementation (default ``pallas_gpu_interpret``: the GPU
kernels as the CPU lowers them in interpret mode; ``xla``: the references). Prints temp / argument /
output bytes per device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from minimax_jax import sharding as sh  # noqa: E402
from minimax_jax.config import ModelConfig  # noqa: E402
from minimax_jax.model.msa_block import msa_block  # noqa: E402
from minimax_jax.model.transformer import _msa_context_parallel  # noqa: E402
from minimax_jax.ops import context_parallel  # noqa: E402

H, G, D, DI = 64, 4, 128, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1048576)
    ap.add_argument("--sequence", default="1,8")
    ap.add_argument("--impl", default="pallas_gpu_interpret")
    args = ap.parse_args(argv)
    t = args.tokens
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = ModelConfig.from_yaml(os.path.join(root, "configs", "tiny-m3.yaml")).replace(
        num_heads=H, num_kv_heads=G, head_dim=D, index_head_dim=DI, index_num_heads=G, index_block_size=128,
        index_topk=16, msa_impl=args.impl, dtype="bfloat16")

    def layer(q, k, v, qi, ki, pos, seg):
        p = context_parallel.plan(1, t, (H, G))
        if p is None:
            o, ks, kc, _, _ = msa_block(q, k, v, qi, ki, cfg, pos, seg, "sparse")
        else:
            o, ks, kc, _, _ = _msa_context_parallel(p, q, k, v, qi, ki, cfg, pos, seg, "sparse")
        return jnp.sum(o.astype(jnp.float32) ** 2) + ks / jnp.maximum(kc, 1)

    grad = jax.grad(layer, argnums=(0, 1, 2, 3, 4))
    devices = len(jax.devices())
    for n in (int(x) for x in args.sequence.split(",")):
        mesh = sh.make_mesh(f"sequence={n},data={devices // n}") if n > 1 else None

        def sds(shape, dt, mesh=mesh):
            if mesh is None:
                return jax.ShapeDtypeStruct(shape, dt)
            return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P(None, "sequence")))

        inputs = (sds((1, t, H, D), jnp.bfloat16), sds((1, t, G, D), jnp.bfloat16), sds((1, t, G, D), jnp.bfloat16),
                  sds((1, t, G, DI), jnp.bfloat16), sds((1, t, DI), jnp.bfloat16), sds((1, t), jnp.int32),
                  sds((1, t), jnp.int32))
        t0 = time.time()
        if mesh is None:
            compiled = jax.jit(grad).lower(*inputs).compile()
        else:
            with sh.use_mesh(mesh, sh.load_rules("default")):
                compiled = jax.jit(grad).lower(*inputs).compile()
        m = compiled.memory_analysis()
        gib = 2.0 ** 30
        print(f"tokens={t} sequence={n} impl={args.impl}: temp {m.temp_size_in_bytes / gib:.2f} GiB, "
              f"arguments {m.argument_size_in_bytes / gib:.2f} GiB, outputs {m.output_size_in_bytes / gib:.2f} GiB "
              f"per device (compiled in {time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
