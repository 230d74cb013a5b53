#!/bin/bash
# Session 13, call 5 (one H200): (1) do the tgmm kernels use Hopper's wgmma? XLA dump of a jit with the
# default tgmm and the transpose_lhs variant at the M2 first projection, wgmma / mma.sync counts in the PTX;
# (2) tgmm sweep incl. transpose_lhs at M2 8K, the adopted config in the M2/M3 8K table, and 5 interleaved
# rounds of grouped matmuls vs dense matmul.
mkdir -p $OUT/dump
XLA_FLAGS="--xla_dump_to=$OUT/dump" timeout 120 python3 - <<'PY'
import jax, jax.numpy as jnp
from pallas_kernels.moe import gpu_gmm
from pallas_kernels.moe.gpu_gmm import TileConfig
m, kd, nd, g = 65536, 3072, 3072, 256
a = jnp.ones((m, kd), jnp.bfloat16); b = jnp.ones((m, nd), jnp.bfloat16); gs = jnp.full((g,), m // g, jnp.int32)
for c in (TileConfig(32, 128, 128, 4, 4), TileConfig(32, 128, 128, 4, 4, transpose_lhs=True)):
    jax.block_until_ready(jax.jit(lambda a, b, gs, c=c: gpu_gmm.tgmm(a, b, gs, config=c))(a, b, gs))
jax.block_until_ready(jax.jit(lambda a, w, gs: gpu_gmm.gmm_forward(a, w, gs))(a, jnp.ones((g, kd, nd), jnp.bfloat16), gs))
print("dumped")
PY
echo "== PTX / LLVM files mentioning the kernels, and their MMA instructions"
for f in $(grep -l -E "tgmm_gpu|gmm_gpu" $OUT/dump/* 2>/dev/null | grep -E "\.(ptx|ll)$"); do
  echo "$(basename $f): wgmma=$(grep -c 'wgmma' $f) mma.sync=$(grep -c 'mma.sync' $f) cp.async=$(grep -c 'cp.async' $f)"
done
ls $OUT/dump | sed 's/.*\.//' | sort | uniq -c | head
rm -rf $OUT/dump
PYTHONUNBUFFERED=1 timeout 300 python3 bench/moe.py --tokens 8192 --models m2,m3 --variants pallas_gpu_gmm,dense_matmul \
  --sweep-kernels tgmm --rounds 5 --budget-s 260 --out $OUT/moe 2>&1 | grep -v "^{" | tee $OUT/call5_moe.log
