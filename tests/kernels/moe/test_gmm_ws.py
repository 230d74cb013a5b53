"""The warp-specialized Mosaic GPU grouped matmul forward / dlhs (pallas_kernels/moe/gpu_gmm_ws.py) on a CPU.

Correctness runs in the Mosaic GPU interpreter (jax >= 0.11; skipped with the reason on older jax) against an
fp64 numpy oracle, every element: ragged groups with starts off 8-row boundaries, empty groups (first, inside,
last), a sum below M (those rows must be exact zeros), M not a multiple of 8, one group holding every row,
the transposed weights of the input gradient, several tile configs. The work list's invariants (every row
stored by exactly one visit, 8-aligned block starts, blocks covering their rows) are checked on any jax, the
CUDA lowering (Mosaic GPU layout inference included) at M2 shapes, and config / input errors everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import mosaic_interpreter_available as interpreter_available
from pallas_kernels.moe.gpu_gmm_ws import WS_GMM_CANDIDATES, WsGmmConfig, gmm_ws, ws_visits

needs_interpreter = pytest.mark.skipif(
    not interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")


def _oracle(lhs, rhs, sizes, transpose_rhs):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = np.swapaxes(rhs, 1, 2)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, s in enumerate(sizes):
        out[start:start + s] = lhs[start:start + s] @ rhs[g]
        start += s
    return out, start


def _sizes(rng, m, g, empty, total):
    cuts = np.sort(rng.choice(np.arange(1, total), size=g - len(empty) - 1, replace=False))
    parts = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes = np.zeros(g, np.int64)
    sizes[[i for i in range(g) if i not in empty]] = parts
    return sizes


@needs_interpreter
@pytest.mark.parametrize("cfg,transpose_rhs", [(WsGmmConfig(64, 128, 2, num_sms=3), False),
                                               (WsGmmConfig(64, 256, 3, num_sms=2), False),
                                               (WsGmmConfig(128, 128, 2, num_sms=5), True), (WsGmmConfig(64, 256, 3, num_sms=4), True)],
                         ids=lambda x: x.label() if isinstance(x, WsGmmConfig) else f"t{int(x)}")
def test_matches_fp64_oracle_ragged_groups(cfg, transpose_rhs):
    seed = 1000 * cfg.block_k + cfg.block_n + int(transpose_rhs)
    rng = np.random.default_rng(seed)
    m, k, n, g = 333, 2 * cfg.block_k, cfg.block_n, 7
    sizes = _sizes(rng, m, g, empty=[0, 3, 6], total=301)         # 32 rows past the sum; starts off 8
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = jnp.asarray(rng.normal(size=shape) / np.sqrt(k), jnp.bfloat16)
    got = np.asarray(gmm_ws(lhs, rhs, jnp.asarray(sizes, jnp.int32), transpose_rhs=transpose_rhs, config=cfg,
                            interpret=True), np.float64)
    ref, total = _oracle(lhs, rhs, sizes, transpose_rhs)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got[:total], ref[:total], rtol=2.0 ** -8, atol=1e-5 * np.abs(ref).max(),
                               err_msg=f"seed {seed}")
    assert np.all(got[total:] == 0), f"rows past the sum, seed {seed}"


@needs_interpreter
def test_one_group_every_row_and_m_off_8():
    rng = np.random.default_rng(5)
    cfg = WsGmmConfig(64, 128, 2, num_sms=2)
    for m, sizes in ((203, [203]), (130, [0, 130])):
        lhs = jnp.asarray(rng.normal(size=(m, 64)), jnp.bfloat16)
        rhs = jnp.asarray(rng.normal(size=(len(sizes), 64, 128)) / 8, jnp.bfloat16)
        got = np.asarray(gmm_ws(lhs, rhs, jnp.asarray(sizes, jnp.int32), config=cfg, interpret=True), np.float64)
        ref, _ = _oracle(lhs, rhs, sizes, False)
        np.testing.assert_allclose(got, ref, rtol=2.0 ** -8, atol=1e-5 * np.abs(ref).max(), err_msg=str(sizes))


@pytest.mark.parametrize("seed", range(6))
def test_visits_store_every_row_once(seed):
    """ws_visits: 8-aligned block starts, blocks holding their live rows, every row of [0, m) stored by exactly one
    visit (the rows past the sum by the zero pseudo-group), within the static bound."""
    rng = np.random.default_rng(seed)
    g, bm = int(rng.integers(1, 12)), 128
    m = int(rng.integers(1, 2000))
    sizes = rng.integers(-3, 400, g)
    tab = np.asarray(ws_visits(jnp.asarray(sizes, jnp.int32), m, bm))
    cover = np.zeros(m, int)
    clipped = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
    starts = np.concatenate([[0], clipped[:-1]])
    for gi, row0, lo, hi in tab.T:
        assert row0 % 8 == 0 and 0 <= lo <= hi <= bm
        if hi > lo:
            rows = np.arange(row0 + lo, row0 + hi)
            cover[rows] += 1
            if gi < g:
                assert np.all((rows >= starts[gi]) & (rows < clipped[gi])), (seed, gi)
            else:
                assert np.all(rows >= clipped[-1]), seed
    assert np.all(cover == 1), seed


def test_lowers_for_cuda_at_m2_shapes():
    """Forward ([65536, 3072] x [256, 3072, 3072]) and dlhs (transposed weights) lower for CUDA on this CPU
    machine, every candidate and M not a multiple of 8."""
    sd = jax.ShapeDtypeStruct
    for cfg in WS_GMM_CANDIDATES:
        c = WsGmmConfig(cfg.block_k, cfg.block_n, cfg.stages, num_sms=132)
        for t in (False, True):
            f = jax.jit(lambda a, b, gs, c=c, t=t: gmm_ws(a, b, gs, transpose_rhs=t, config=c))
            low = f.trace(sd((65535, 3072), jnp.bfloat16), sd((256, 3072, 3072), jnp.bfloat16),
                          sd((256,), jnp.int32)).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in low.as_text(), (c.label(), t)


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="block_k must be 64 or 128"):
        WsGmmConfig(32)
    with pytest.raises(ValueError, match="block_n must be 128 or 256"):
        WsGmmConfig(64, 64)
    with pytest.raises(ValueError, match="shared memory"):
        WsGmmConfig(128, 256, 4)
    x = jnp.zeros((64, 128), jnp.bfloat16)
    gs = jnp.asarray([64], jnp.int32)
    with pytest.raises(TypeError, match="bf16 / f16"):
        gmm_ws(x.astype(jnp.float32), jnp.zeros((1, 128, 256), jnp.float32), gs, config=WsGmmConfig(num_sms=1))
    with pytest.raises(ValueError, match="N % 256"):
        gmm_ws(x, jnp.zeros((1, 128, 384), jnp.bfloat16), gs, config=WsGmmConfig(num_sms=1))
    with pytest.raises(ValueError, match="contraction mismatch"):
        gmm_ws(x, jnp.zeros((1, 64, 256), jnp.bfloat16), gs, config=WsGmmConfig(num_sms=1))
    with pytest.raises(TypeError, match="WsGmmConfig"):
        gmm_ws(x, jnp.zeros((1, 128, 256), jnp.bfloat16), gs, config=object())


@needs_interpreter
def test_gmm_vjp_with_ws_forward_and_dlhs():
    """``gpu_gmm.gmm`` with a ``WsGmmConfig`` as config and dlhs_config: the forward and the input gradient run
    this kernel (the weight gradient the Triton tgmm), against ragged_dot's value and VJP in fp32."""
    from pallas_kernels.moe import gpu_gmm

    rng = np.random.default_rng(11)
    m, k, n = 200, 128, 256
    sizes = jnp.asarray([37, 0, 90, 51], jnp.int32)                  # 22 rows past the sum
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(4, k, n)) / np.sqrt(k), jnp.bfloat16)
    cot = jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16)
    ws = WsGmmConfig(64, 256, 2, num_sms=3)
    y, vjp = jax.vjp(lambda a, b: gpu_gmm.gmm(a, b, sizes, config=ws, dlhs_config=WsGmmConfig(128, 128, 2, num_sms=2),
                                              interpret=True), lhs, rhs)
    dlhs, drhs = vjp(cot)
    f = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision=jax.lax.Precision.HIGHEST,   # noqa: E731
                                        preferred_element_type=jnp.float32)
    ry, rvjp = jax.vjp(f, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    rdlhs, rdrhs = rvjp(cot.astype(jnp.float32))
    for got, ref, what in ((y, ry, "y"), (dlhs, rdlhs, "dlhs"), (drhs, rdrhs, "drhs")):
        ref = np.asarray(ref, np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2.0 ** -7, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=what)
    assert np.all(np.asarray(y, np.float32)[178:] == 0) and np.all(np.asarray(dlhs, np.float32)[178:] == 0)
