"""Per-device memory of one M3-shaped MSA layer's forward + backward with context parallelism: XLA's
buffer plan (``compiled.memory_analysis()``), nothing runs.

Usage (CPU; the device count must be set before JAX starts)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python bench/cp_memory.py --tokens 1048576 --sequence 1,8

The GPU compiler's plan on any machine, no GPU needed (compile-only devices: eight H200s as
``configs/gpu_targets/h200.txtpb`` describes them, ``minimax_jax.aot``; needs ``pip install "jax[cuda13]"``)::

    python3 bench/cp_memory.py --impl pallas_hopper_gpu --gpu-target h200 --gpus 8 --tokens 1048576 --sequence 1,8

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
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from minimax_jax import aot  # noqa: E402
from minimax_jax import sharding as sh  # noqa: E402
from minimax_jax.config import ModelConfig  # noqa: E402
from minimax_jax.model.msa_block import msa_block  # noqa: E402
from minimax_jax.model.transformer import _msa_context_parallel  # noqa: E402
from minimax_jax.ops import assume_backend, context_parallel  # noqa: E402

H, G, D, DI = 64, 4, 128, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1048576)
    ap.add_argument("--sequence", default="1,8")
    ap.add_argument("--impl", default=None, help="MSA implementation (default: pallas_gpu_interpret, or with "
                                                 "--gpu-target pallas_hopper_gpu, what auto runs on an H200)")
    ap.add_argument("--gpu-target", default=None,
                    help="compile for these GPUs without having them: a name in configs/gpu_targets (h200) or a "
                         "GpuTargetConfig text proto (minimax_jax.aot; the GPU compiler's plan, nothing runs)")
    ap.add_argument("--gpus", type=int, default=None, help="with --gpu-target: the number of GPUs (one host; 8)")
    ap.add_argument("--local-program", action="store_true",
                    help="for each n > 1 compile, on one device, what one of n devices runs: its T/n queries against "
                         "the gathered keys (the inputs hold the gathered K/V; no collective buffers)")
    ap.add_argument("--dump-hlo", default="", help="write each compiled program's HLO text into this folder")
    args = ap.parse_args(argv)
    if args.gpus is not None and args.gpu_target is None:
        ap.error("--gpus applies only with --gpu-target")
    ns = [int(x) for x in args.sequence.split(",")]
    all_devices = jax.devices()
    if args.gpu_target is not None:
        args.impl = args.impl or "pallas_hopper_gpu"
        if args.impl.endswith("_interpret"):
            ap.error(f"--impl {args.impl}: with --gpu-target the kernels compile for the GPU; "
                     "name a GPU implementation")
        try:
            all_devices = aot.compile_only_gpus(args.gpu_target, args.gpus or 8)
        except ValueError as e:
            ap.error(str(e))
    args.impl = args.impl or "pallas_gpu_interpret"
    if bad := [n for n in ns if n < 1 or len(all_devices) % n]:
        ap.error(f"--sequence {bad[0]} does not divide the {len(all_devices)} devices")
    one = jax.sharding.SingleDeviceSharding(all_devices[0])
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

    def local_layer(q, k, v, qi, ki, qpos, qseg, kpos, kseg):      # one device's share, keys gathered
        o, ks, kc, _, _ = msa_block(q, k, v, qi, ki, cfg, qpos, qseg, "sparse", kv_positions=kpos, kv_segment_ids=kseg)
        return jnp.sum(o.astype(jnp.float32) ** 2) + ks / jnp.maximum(kc, 1)

    devices = len(all_devices)
    with assume_backend("gpu") if args.gpu_target is not None else contextlib.nullcontext():
        return _plans(args, ns, t, devices, all_devices, one, grad, local_layer)


def _plans(args, ns, t, devices, all_devices, one, grad, local_layer) -> int:
    for n in ns:
        if args.local_program and n > 1:
            def s_(shape, dt):
                return jax.ShapeDtypeStruct(shape, dt, sharding=one)
            tl = t // n
            inputs = (s_((1, tl, H, D), jnp.bfloat16), s_((1, t, G, D), jnp.bfloat16), s_((1, t, G, D), jnp.bfloat16),
                      s_((1, tl, G, DI), jnp.bfloat16), s_((1, t, DI), jnp.bfloat16), s_((1, tl), jnp.int32),
                      s_((1, tl), jnp.int32), s_((1, t), jnp.int32), s_((1, t), jnp.int32))
            t0 = time.time()
            m = jax.jit(jax.grad(local_layer, argnums=(0, 1, 2, 3, 4))).lower(*inputs).compile().memory_analysis()
            _print(t, f"{n} (one device's program)", args.impl, m, t0, all_devices[0].device_kind)
            continue
        mesh = sh.make_mesh(f"sequence={n},data={devices // n}", all_devices) if n > 1 else None

        def sds(shape, dt, mesh=mesh):
            if mesh is None:
                return jax.ShapeDtypeStruct(shape, dt, sharding=one)
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
        _print(t, n, args.impl, compiled.memory_analysis(), t0, all_devices[0].device_kind)
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            with open(os.path.join(args.dump_hlo, f"tokens{t}_sequence{n}.hlo.txt"), "w") as f:
                f.write(compiled.as_text())
    return 0


def _print(t, n, impl, m, t0, kind):
    gib = 2.0 ** 30
    print(f"[{kind}] tokens={t} sequence={n} impl={impl}: temp {m.temp_size_in_bytes / gib:.2f} GiB, "
          f"arguments {m.argument_size_in_bytes / gib:.2f} GiB, outputs {m.output_size_in_bytes / gib:.2f} GiB "
          f"per device (compiled in {time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
