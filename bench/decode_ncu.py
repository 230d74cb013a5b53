"""One launch of each MSA decode kernel at one (batch, context), for Nsight Compute (issue 7).

Runs, in this order and once each: the page-scoring kernel with bf16 index keys, the same with fp8
index keys (``gpu_config.DEFAULT_TABLE`` launch defaults), the top-k selection, the sparse (MSA) attention over
the selected pages, and the dense paged decode attention over the same cache: M3 shapes of
``bench/msa_decode.py`` (64 / 4 heads of 128, index head dim 128, 128-token pages, K = 16), Q = 1,
shuffled page tables. Each output is checked finite, so a kernel that silently wrote nothing fails.

On the H200 (Firecracker machines: ``ncu`` reads counters; keep the clocks as they are)::

    ncu --clock-control none -k regex:'msa_decode|paged_decode' --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section WarpStateStats python3 bench/decode_ncu.py --batch 32 --context 1048576

CPU plumbing (interpret mode, tiny): ``python bench/decode_ncu.py --batch 1 --context 1024 --interpret``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.decode.cache import quantize  # noqa: E402
from msa_decode import DI, D, G, H, K, PAGE, fill  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1 << 20, help="tokens per request (a multiple of 128)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU plumbing)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense K/V cache and dense decode")
    a = ap.parse_args()
    if a.context % PAGE or a.context < 2 * PAGE or a.batch < 1:
        ap.error(f"--context must be a multiple of {PAGE} (>= {2 * PAGE}) and --batch >= 1")
    from pallas_kernels.decode import gpu_attention, gpu_config, gpu_select

    b, npg = a.batch, a.context // PAGE
    p = b * npg + 1
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(np.arange(1, p)).reshape(b, npg), jnp.int32)
    pos = jnp.full((b, 1), a.context - 1, jnp.int32)
    kib = fill((p, PAGE, DI), 3, jnp.bfloat16)
    ki8, ks8 = jax.jit(lambda x: quantize(x, "float8_e4m3fn"))(kib)
    qi = jax.random.normal(jax.random.PRNGKey(1), (b, 1, G, DI), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(2), (b, 1, H, D), jnp.bfloat16)
    it = a.interpret
    print("config", gpu_config.DEFAULT_TABLE.to_dict(), flush=True)
    s16 = jax.block_until_ready(gpu_select.page_scores_gpu(qi, kib, table, pos, interpret=it))
    s8 = jax.block_until_ready(gpu_select.page_scores_gpu(qi, ki8, table, pos, ks8, interpret=it))
    ids = jax.block_until_ready(gpu_select.select_pages_gpu(qi, kib, table, pos, topk=K, interpret=it))
    done = [("scores_bf16", s16[..., : npg - 1]), ("scores_fp8", s8[..., : npg - 1])]
    del kib, ki8, ks8
    kp = fill((G, p, PAGE, D), 1, jnp.bfloat16)
    vp = fill((G, p, PAGE, D), 2, jnp.bfloat16)
    o_s, _ = jax.block_until_ready(gpu_attention.paged_attention_gpu(q, kp, vp, table, pos, block_ids=ids,
                                                                      interpret=it))
    done += [("sparse_attention", o_s)]
    if not a.no_dense:
        o_d, _ = jax.block_until_ready(gpu_attention.paged_attention_gpu(q, kp, vp, table, pos, interpret=it))
        done += [("dense_attention", o_d)]
    assert int(jnp.min(ids[..., 0])) >= 0, "selection left a row empty"
    for name, x in done:
        ok = bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
        print(f"{name}: shape {tuple(x.shape)} finite {ok}", flush=True)
        assert ok, f"{name} has non-finite values"
    print("ok", flush=True)


if __name__ == "__main__":
    main()
