"""FP8 experts kept in FP8 (``Fp8Weight``): dequantisation against NumPy (partial edge tiles, blocks finer than
128), the grouped matmul and every MoE implementation on FP8 weights against float64 NumPy loops over the
dequantised weights (every element; empty groups; rows past the group sum), indexing and scans of stacked
leaves. (Bytes of whole FP8 vs bf16 models: ``tests/convert/test_convert_fp8_keep.py``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from minimax_jax.ops import moe
from minimax_jax.ops.moe import Fp8Weight
from minimax_jax.ops.moe.grouped_matmul import FP8_REPORT, grouped_matmul
from minimax_jax.ops.registry import clear_implementation_report, implementation_report

N, H, E, I, K = 29, 200, 5, 136, 2     # H, 2I not multiples of 128: partial edge tiles


def _np_quantize(w, block):
    """Independent block quantiser: scale = amax(tile) / 448, e4m3 of w / scale (ml_dtypes rounding)."""
    r, c = w.shape[-2:]
    sr, sc = -(-r // block[0]), -(-c // block[1])
    scale = np.ones(w.shape[:-2] + (sr, sc), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    deq = np.empty(w.shape, np.float64)
    for i in range(sr):
        for j in range(sc):
            sl = (..., slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            t = w[sl]
            amax = np.abs(t).max(axis=(-2, -1))
            s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
            scale[..., i, j] = s
            q[sl] = (t / s[..., None, None]).astype(ml_dtypes.float8_e4m3fn)
            deq[sl] = q[sl].astype(np.float64) * s[..., None, None]
    return q, scale, deq


def _fp8(shape, block, seed):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3
    q, s, deq = _np_quantize(w, block)
    return Fp8Weight(jnp.asarray(q), jnp.asarray(s), block), deq


@pytest.mark.parametrize("block", [(128, 128), (128, 8), (64, 16)])
def test_dequantize_matches_numpy(block):
    fw, deq = _fp8((3, H, 2 * I), block, 1)
    assert fw.scale_inv.shape == (3, -(-H // block[0]), -(-2 * I // block[1]))
    np.testing.assert_array_equal(np.asarray(fw.astype(jnp.float32)), deq.astype(np.float32))
    got16 = np.asarray(jax.jit(lambda w: w.astype(jnp.bfloat16))(fw))
    np.testing.assert_array_equal(got16, deq.astype(np.float32).astype(ml_dtypes.bfloat16))
    one = fw[1]
    assert isinstance(one, Fp8Weight) and one.shape == (H, 2 * I) and one.block == block
    np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), deq[1].astype(np.float32))
    with pytest.raises(IndexError, match="leading axes"):
        fw[0, 1]
    assert fw.nbytes == 3 * H * 2 * I + 4 * fw.scale_inv.size


def test_stacked_leaves_scan_and_pytree():
    """A stacked ``[L, ...]`` FP8 leaf scans layer by layer (as the forward does) and flattens to w, scale_inv."""
    fw, deq = _fp8((4, 40, 24), (16, 8), 2)
    assert [x.dtype for x in jax.tree.leaves(fw)] == [jnp.float8_e4m3fn, jnp.float32]
    x = jnp.ones((3, 40), jnp.float32)
    _, ys = jax.lax.scan(lambda c, w: (c, x @ w.astype(x.dtype)), 0, fw)
    np.testing.assert_allclose(np.asarray(ys), np.einsum("nk,lkm->lnm", np.ones((3, 40)), deq), rtol=1e-5, atol=1e-5)


def _np_gmm(lhs, deq, sizes):
    out = np.zeros((lhs.shape[0], deq.shape[-1]))
    o = 0
    for g, n in enumerate(sizes):
        out[o:o + n] = np.asarray(lhs[o:o + n], np.float64) @ deq[g]
        o += n
    return out, o


FP8_WAYS = {"xla": "dequantised 8 experts per scan step (xla)",
            ("pallas_gpu_interpret", (128, 8)): "dequantised before the kernel (scale block (128, 8) is not a multiple "
                                                "of 16 x 16 (the smallest weight tile))",
            ("pallas_gpu_interpret", (128, 128)): "dequantised per tile in the kernel (gmm_fp8, 16x128x128w4s4)"}


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu_interpret"])
@pytest.mark.parametrize("groups", [5, 16])   # 16: two scan chunks of the xla path
@pytest.mark.parametrize("block", [(128, 8), (128, 128)])     # the kernel dequantises (128, 128) blocks per tile
def test_grouped_matmul_fp8_matches_numpy(impl, groups, block):
    clear_implementation_report()
    rng = np.random.default_rng(groups)
    fw, deq = _fp8((groups, H, 72), block, groups)
    sizes = rng.integers(0, 7, groups)
    sizes[1] = 0
    m = int(sizes.sum()) + 5                                     # 5 rows past the group sum
    lhs = rng.standard_normal((m, H)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, w, s: grouped_matmul(a, w, s, implementation=impl))(
        jnp.asarray(lhs), fw, jnp.asarray(sizes, jnp.int32)))
    want, live = _np_gmm(lhs, deq, sizes)
    np.testing.assert_allclose(got[:live], want[:live], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[live:], 0.0)
    assert implementation_report()[FP8_REPORT] == FP8_WAYS["xla" if impl == "xla" else (impl, block)]


def test_moe_auto_on_gpu_keeps_fp8_experts_in_the_grouped_kernel():
    """``auto`` on a GPU at decode sizes: FP8 experts go to the grouped kernel (FP8 bytes read once) instead of
    ``xla_dense`` (which would dequantise every expert each step); bf16 experts keep ``xla_dense``. Lowered
    for CUDA on this CPU machine (the GPU backend assumed), nothing run."""
    from minimax_jax.ops.registry import assume_backend
    wi, _ = _fp8((E, 256, 256), (128, 128), 3)
    wo, _ = _fp8((E, 128, 256), (128, 128), 4)
    x = jnp.ones((4, 256), jnp.bfloat16)
    w, ex = jnp.full((4, K), 0.5), jnp.zeros((4, K), jnp.int32)
    for experts, want in (((wi, wo), "pallas_gpu"), ((wi.astype(jnp.bfloat16), wo.astype(jnp.bfloat16)), "xla_dense")):
        clear_implementation_report()
        with assume_backend("gpu"):
            txt = jax.jit(lambda x, a, b: moe.moe_experts(x, w, ex, a, b, _act)).trace(x, *experts).lower(
                lowering_platforms=("cuda",)).as_text()
        assert implementation_report()["moe"] == want
        assert ("gmm_fp8_gpu" in txt) == (want == "pallas_gpu")


def _np_moe(x, weights, experts, wi, wo):
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            g = np.asarray(x[t], np.float64) @ wi[e]
            a, b = np.split(g, 2)
            out[t] += weights[t, j] * ((a / (1 + np.exp(-a)) * b) @ wo[e])
    return out


def _act(g):
    a, b = jnp.split(g.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(g.dtype)


@pytest.mark.parametrize("impl", ["xla_dense", "xla_ragged", "xla_capacity", "pallas_gpu_interpret", "auto"])
def test_moe_experts_on_fp8_weights_match_numpy(impl):
    rng = np.random.default_rng(7)
    wi, wi_d = _fp8((E, H, 2 * I), (128, 8), 8)
    wo, wo_d = _fp8((E, I, H), (128, 128), 9)
    x = rng.standard_normal((N, H)).astype(np.float32)
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (N, K)).astype(np.float32)
    kw = {"capacity_factor": 10.0} if impl == "xla_capacity" else {}
    got = jax.jit(lambda *a: moe.moe_experts(*a, _act, implementation=impl, **kw))(
        jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), wi, wo)
    want = _np_moe(x, weights, experts, wi_d, wo_d)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_fp8_lhs_gradient_keeps_lhs_dtype():
    """The in-kernel FP8 path's lhs gradient is in lhs.dtype over the weights dequantised to it: float32 rows get
    a float32 gradient at float32 accuracy (against float64 NumPy), as the xla path does."""
    rng = np.random.default_rng(3)
    fw, deq = _fp8((4, 128, 64), (64, 64), 5)
    sizes = np.asarray([10, 0, 17, 9], np.int32)
    lhs = jnp.asarray(rng.standard_normal((40, 128)), jnp.float32)
    cot = rng.standard_normal((40, 64))
    want = np.zeros((40, 128))
    o = 0
    for g, n in enumerate(sizes):
        want[o:o + n] = cot[o:o + n] @ deq[g].T
        o += n
    for impl in ("xla", "pallas_gpu_interpret"):
        clear_implementation_report()
        got = jax.grad(lambda a: jnp.sum(grouped_matmul(a, fw, jnp.asarray(sizes), implementation=impl)
                                         * jnp.asarray(cot, jnp.float32)))(lhs)
        assert got.dtype == jnp.float32, impl
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=impl)
    assert implementation_report()[FP8_REPORT].startswith("dequantised per tile in the kernel")



def test_fp8_in_kernel_refused_below_compute_capability_8_9(monkeypatch):
    """Triton converts e4m3 only from compute capability 8.9: an older GPU dequantises first (with the reason),
    Hopper and a CPU lowering (no GPU visible) keep the in-kernel path; blocks finer than a tile are refused."""
    from minimax_jax.ops.moe import grouped_matmul as gm
    fw, _ = _fp8((2, 128, 128), (128, 128), 1)
    for cc, want in (("8.0", "compute capability 8.0: Triton converts float8_e4m3fn from 8.9 on"), ("8.9", None),
                     ("9.0", None), (None, None)):
        monkeypatch.setattr(gm, "gpu_compute_capability", lambda cc=cc: cc)
        assert gm._fp8_in_kernel_problem(fw, interpret=False) == want
    assert "16 x 16" in gm._fp8_in_kernel_problem(_fp8((2, 128, 128), (128, 8), 1)[0], interpret=True)
