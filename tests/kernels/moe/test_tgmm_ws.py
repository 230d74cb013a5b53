"""The warp-specialized Mosaic GPU weight gradient (pallas_kernels/moe/gpu_tgmm_ws.py) on a CPU.

Correctness runs in the Mosaic GPU interpreter (jax >= 0.11; jax 0.10's interpreter cannot interpret
``transpose_ref`` views, so those tests skip there and say so), against an fp64 numpy oracle, every element:
ragged groups with unaligned starts (the 8-row-aligned blocks and both masks), empty groups, a sum
below M (rows past the sum unused), the last group ending at M, several tile configs, and through
``gpu_gmm.gmm``'s VJP. The CUDA lowering (Mosaic GPU layout inference included) is checked at M2 shapes
on any jax. Config and input errors are checked everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import gpu_gmm
from pallas_kernels.common import mosaic_interpreter_available as interpreter_available
from pallas_kernels.moe.gpu_tgmm_ws import WS_TGMM_CANDIDATES, WsTgmmConfig, tgmm_ws

needs_interpreter = pytest.mark.skipif(
    not interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")


def _oracle(lhs, dout, sizes):
    lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    out = np.zeros((len(sizes), lhs.shape[1], dout.shape[1]))
    start = 0
    for g, s in enumerate(sizes):
        out[g] = lhs[start:start + s].T @ dout[start:start + s]
        start += s
    return out


def _check(got, ref, what):
    got = np.asarray(got, np.float64)
    # bf16 output of an fp32 sum: within half a bf16 ulp of the exact value, plus fp32 summation order
    np.testing.assert_allclose(got, ref, rtol=2.0 ** -8, atol=1e-5 * np.abs(ref).max(), err_msg=what)


def _case(rng, sizes, m, k, n):
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    dout = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    return lhs, dout, jnp.asarray(sizes, jnp.int32)


@needs_interpreter
@pytest.mark.parametrize("cfg", [WsTgmmConfig(64, 128, 256, 3, num_sms=3), WsTgmmConfig(64, 64, 128, 2, num_sms=2),
                                 WsTgmmConfig(128, 64, 256, 2, num_sms=5)], ids=lambda c: c.label())
def test_matches_fp32_oracle_ragged_groups(cfg):
    seed = 0
    rng = np.random.default_rng(seed)
    # unaligned starts (3, 70, 203 ...), an empty group, groups shorter than one block and longer than
    # two, a block-multiple group; sum < M: the rows past it belong to no group
    sizes = np.array([3, 67, 0, 133, cfg.block_rows, 9, 1])
    m = int(sizes.sum()) + 21
    k, n = 2 * cfg.block_k, cfg.block_n
    lhs, dout, gs = _case(rng, sizes, m, k, n)
    got = tgmm_ws(lhs, dout, gs, config=cfg, interpret=True)
    assert got.shape == (len(sizes), k, n) and got.dtype == jnp.bfloat16
    _check(got, _oracle(lhs, dout, sizes), f"{cfg.label()} seed {seed}")
    assert np.all(np.asarray(got[2]) == 0)              # the empty group: exact zeros


@needs_interpreter
def test_last_group_ends_at_m_and_random_sizes():
    """Random sizes summing to M exactly (the last block reads past M: TMA zero fill), f16 in and out."""
    seed = 1
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 90, size=6)
    m = int(sizes.sum())
    cfg = WsTgmmConfig(64, 64, 128, 3, num_sms=4)
    lhs = jnp.asarray(rng.normal(size=(m, 128)), jnp.float16)
    dout = jnp.asarray(rng.normal(size=(m, 256)), jnp.float16)
    got = tgmm_ws(lhs, dout, jnp.asarray(sizes, jnp.int32), config=cfg, interpret=True)
    assert got.dtype == jnp.float16
    _check(got, _oracle(lhs, dout, sizes), f"sizes {sizes.tolist()} seed {seed}")


@needs_interpreter
def test_gmm_vjp_with_ws_weight_gradient():
    """gpu_gmm.gmm with tgmm_config=WsTgmmConfig: drhs from the Mosaic kernel equals the Triton tgmm's
    (both in their interpreters) and the fp32 oracle; y and dlhs are untouched."""
    seed = 2
    rng = np.random.default_rng(seed)
    sizes = np.array([40, 0, 77, 13])
    m = int(sizes.sum()) + 6
    lhs, _, gs = _case(rng, sizes, m, 128, 8)
    rhs = jnp.asarray(0.2 * rng.normal(size=(4, 128, 256)), jnp.bfloat16)
    cot = jnp.asarray(rng.normal(size=(m, 256)), jnp.bfloat16)

    def run(tcfg):
        y, vjp = jax.vjp(lambda a, b: gpu_gmm.gmm(a, b, gs, tgmm_config=tcfg, interpret=True), lhs, rhs)
        return (y, *vjp(cot))
    got = run(WsTgmmConfig(64, 128, 256, 2, num_sms=3))
    tri = run(None)
    for a, b in zip(got[:2], tri[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _check(got[2], _oracle(lhs, cot, sizes), f"drhs vs oracle, seed {seed}")
    np.testing.assert_allclose(np.asarray(got[2], np.float64), np.asarray(tri[2], np.float64), rtol=2.0 ** -7,
                               atol=1e-5 * float(jnp.abs(tri[2].astype(jnp.float32)).max()))


@needs_interpreter
def test_clipped_sizes_and_no_groups():
    """Negative sizes count as 0, a size past M (near 2**31) is clipped to the rows left, M = 83 (not a
    multiple of 8: padded); G = 0 gives an empty result."""
    rng = np.random.default_rng(0)
    lhs, dout, _ = _case(rng, [], 83, 64, 128)
    sizes = [20, -5, 2**31 - 1, 7]
    got = tgmm_ws(lhs, dout, jnp.asarray(sizes, jnp.int32), config=WsTgmmConfig(64, 64, 128, 2, num_sms=3),
                  interpret=True)
    _check(got, _oracle(lhs, dout, [20, 0, 63, 0]), "clipped sizes")
    empty = tgmm_ws(lhs, dout, jnp.zeros((0,), jnp.int32), config=WsTgmmConfig(64, 64, 128, 2, num_sms=3))
    assert empty.shape == (0, 64, 128)


def test_lowers_for_cuda_at_m2_shapes():
    """The kernel lowers for CUDA on this CPU machine (Mosaic GPU layout inference included) at M2's
    first-projection weight gradient ([65536, 3072]^T x [65536, 3072], 256 groups), every candidate."""
    sd = jax.ShapeDtypeStruct
    for cfg in WS_TGMM_CANDIDATES:
        c = WsTgmmConfig(cfg.block_rows, cfg.block_k, cfg.block_n, cfg.stages, num_sms=132)
        f = jax.jit(lambda a, b, g, c=c: tgmm_ws(a, b, g, config=c))
        low = f.trace(sd((65536, 3072), jnp.bfloat16), sd((65536, 3072), jnp.bfloat16),
                      sd((256,), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in low.as_text(), c.label()
    # M not a multiple of 8 (Mosaic GPU's 8-row SMEM tiling): padded, lowers
    f = jax.jit(lambda a, b, g: tgmm_ws(a, b, g, config=WsTgmmConfig(num_sms=132)))
    low = f.trace(sd((65535, 3072), jnp.bfloat16), sd((65535, 3072), jnp.bfloat16),
                  sd((256,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in low.as_text()


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="block_rows"):
        WsTgmmConfig(block_rows=32)
    with pytest.raises(ValueError, match="block_k"):
        WsTgmmConfig(block_k=256)
    with pytest.raises(ValueError, match="block_n"):
        WsTgmmConfig(block_n=512)
    with pytest.raises(ValueError, match="stages"):
        WsTgmmConfig(stages=1)
    with pytest.raises(ValueError, match="block_rows must be an int"):
        WsTgmmConfig(block_rows=64.0)
    with pytest.raises(ValueError, match="num_sms"):
        WsTgmmConfig(num_sms=True)
    assert WsTgmmConfig(stages=np.int64(2), num_sms=np.int64(4)) == WsTgmmConfig(stages=2, num_sms=4)
    with pytest.raises(ValueError, match="shared memory"):
        WsTgmmConfig(128, 128, 256, 3)
    x = jnp.zeros((64, 128), jnp.bfloat16)
    gs = jnp.array([64], jnp.int32)
    with pytest.raises(TypeError, match="bf16 / f16"):
        tgmm_ws(x.astype(jnp.float32), jnp.zeros((64, 256), jnp.float32), gs)
    with pytest.raises(ValueError, match="N % 256"):
        tgmm_ws(x, jnp.zeros((64, 192), jnp.bfloat16), gs)
    with pytest.raises(ValueError, match=r"lhs \[M, K\]"):
        tgmm_ws(x, jnp.zeros((32, 256), jnp.bfloat16), gs)
    with pytest.raises(TypeError, match="WsTgmmConfig"):
        tgmm_ws(x, jnp.zeros((64, 256), jnp.bfloat16), gs, config=gpu_gmm.DEFAULT_TGMM_CONFIG)
    with pytest.raises(TypeError, match="tgmm_config"):
        gpu_gmm.gmm(x, jnp.zeros((1, 128, 256), jnp.bfloat16), gs, tgmm_config="ws")
    if not interpreter_available():
        with pytest.raises(NotImplementedError, match="jax >= 0.11"):
            tgmm_ws(x, jnp.zeros((64, 256), jnp.bfloat16), gs, config=WsTgmmConfig(num_sms=1), interpret=True)


def test_default_configs_are_constants_and_ws_is_for_tgmm_only():
    """The default tiles are a read-only table; a WsTgmmConfig is accepted as tgmm_config only."""
    assert dict(gpu_gmm.DEFAULT_CONFIGS) == {"fwd": gpu_gmm.DEFAULT_CONFIG, "dlhs": gpu_gmm.DEFAULT_DLHS_CONFIG,
                                            "tgmm": gpu_gmm.DEFAULT_TGMM_CONFIG}
    with pytest.raises(TypeError):
        gpu_gmm.DEFAULT_CONFIGS["tgmm"] = WsTgmmConfig(num_sms=2)
    ws = WsTgmmConfig(num_sms=2)
    x = jnp.zeros((64, 128), jnp.bfloat16)
    rhs = jnp.zeros((1, 128, 256), jnp.bfloat16)
    gs = jnp.array([64], jnp.int32)
    assert jax.eval_shape(lambda a, b: gpu_gmm.gmm(a, b, gs, tgmm_config=ws, interpret=True), x, rhs).shape == (64, 256)
    with pytest.raises(TypeError, match="configs must be TileConfig"):
        gpu_gmm.gmm(x, rhs, gs, config=ws, interpret=True)
    with pytest.raises(TypeError, match="configs must be TileConfig"):
        gpu_gmm.gmm(x, rhs, gs, dlhs_config=ws, interpret=True)
