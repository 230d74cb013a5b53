"""Pallas GPU grouped matmul (pallas_kernels/moe/gpu_gmm.py) in interpret mode on CPU.

Oracle: ``jax.lax.ragged_dot`` and its autodiff gradients in float32 (Precision.HIGHEST), on the
same (bf16-rounded where the case is bf16) inputs. Seeded random inputs and group sizes
(empty groups, sizes not multiples of the tiles, sum < M); every element is compared.
Tolerances: fp32 cases rtol = atol/scale = 2e-5 (accumulation order only); bf16 cases: the kernels
accumulate in fp32 and round once to bf16, so |err| <= 2^-8 |ref| (half a bf16 ulp) plus
1e-5 * max|ref| for the accumulation order: rtol 4e-3, atol 1e-5 * max|ref|.
Exact checks: rows past sum(group_sizes) of y and dlhs are 0, empty groups' drhs are 0.
Tail folding (TileConfig.fold): group sizes built to hit every case of the work list (remainder 0,
remainder <= fold after one and after several full blocks, at the fold bound, remainder > fold,
groups smaller than a block or than fold, empty groups, rows past the sum, a folded group ending at
the last row, a single group), in a seeded random order; compared with the oracle and with
the same config without folding (forward, dlhs, drhs), and the work list's invariants directly.
A lowering test checks that the three kernels lower for CUDA at M2 shapes on this CPU machine
(Triton IR is generated; the Triton compile itself needs the GPU).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import moe, registry
from minimax_jax.ops.moe.grouped_matmul import grouped_matmul, zeros_past_sum
from minimax_jax.ops.registry import (ImplementationUnavailable, assume_backend, clear_implementation_report,
                                      implementation_report)
from pallas_kernels.moe import gpu_gmm
from pallas_kernels.moe.gpu_gmm import TileConfig

HI = jax.lax.Precision.HIGHEST
SMALL = TileConfig(32, 32, 64, 4, 2)          # several row / K / N tiles at test sizes
SMALL_T = TileConfig(32, 32, 64, 4, 2)        # tgmm: 32x64 output tiles, 32 rows per step


def _sizes(rng, m, g, n_empty):
    """Random group sizes with ``n_empty`` empty groups (incl. the first or last) and sum < m."""
    total = int(rng.integers(m * 2 // 3, m - 3))
    live = g - n_empty
    cuts = np.sort(rng.choice(np.arange(1, total), size=live - 1, replace=False))
    parts = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes = np.zeros(g, np.int64)
    empty = rng.choice(np.arange(1, g - 1), size=n_empty - 1, replace=False).tolist() + [rng.choice([0, g - 1])]
    sizes[[i for i in range(g) if i not in empty]] = parts
    assert sizes.sum() == total < m and (sizes == 0).sum() == n_empty
    return sizes


def _case(seed, m, k, n, g, n_empty, dtype):
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, m, g, n_empty)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), dtype)
    cot = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), cot, sizes


@jax.jit
def _reference(lhs, rhs, gs, cot):
    f = lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=HI, preferred_element_type=jnp.float32)  # noqa: E731
    y, vjp = jax.vjp(f, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    return (y, *vjp(cot.astype(jnp.float32)))


def _kernel(lhs, rhs, gs, cot, cfg=SMALL, tcfg=SMALL_T):
    @jax.jit
    def f(lhs, rhs, cot):
        y, vjp = jax.vjp(lambda a, b: gpu_gmm.gmm(a, b, gs, config=cfg, dlhs_config=cfg, tgmm_config=tcfg,
                                                  interpret=True), lhs, rhs)
        return (y, *vjp(cot))
    return f(lhs, rhs, cot)


def _close(got, ref, dtype, what, rtol=None):
    """fp32: 2e-5 relative. bf16 against an fp32 reference: the kernel rounds once, half a bf16 ulp (<= 2**-8
    of the value) plus summation order: 4e-3. Pass ``rtol=2**-7`` where the reference is bf16-rounded too
    (two roundings of nearly equal fp32 sums may differ by one ulp, up to 2**-7 of the value)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, ref, rtol=rtol or 2e-5, atol=2e-5 * scale, err_msg=what)
    else:
        np.testing.assert_allclose(got, ref, rtol=rtol or 4e-3, atol=1e-5 * scale, err_msg=what)


CASES = [  # (m, k, n, g, n_empty, dtype)
    (250, 64, 192, 7, 2, jnp.float32),
    (300, 128, 64, 9, 3, jnp.float32),
    (217, 72, 100, 5, 1, jnp.float32),        # K and N not multiples of the tiles (masked tails)
    (256, 128, 192, 9, 3, jnp.bfloat16),
    (200, 64, 64, 6, 2, jnp.bfloat16),
]


@pytest.mark.parametrize("m,k,n,g,n_empty,dtype", CASES)
def test_gmm_forward_and_gradients_match_ragged_dot(m, k, n, g, n_empty, dtype):
    lhs, rhs, gs, cot, sizes = _case(None, m, k, n, g, n_empty, dtype)
    y, dlhs, drhs = _kernel(lhs, rhs, gs, cot)
    ry, rdlhs, rdrhs = _reference(lhs, rhs, gs, cot)
    assert y.dtype == dtype and dlhs.dtype == dtype and drhs.dtype == dtype
    assert y.shape == (m, n) and dlhs.shape == (m, k) and drhs.shape == (g, k, n)
    _close(y, ry, dtype, "forward")
    _close(dlhs, rdlhs, dtype, "dlhs")
    _close(drhs, rdrhs, dtype, "drhs")
    total = int(sizes.sum())
    assert np.all(np.asarray(y)[total:] == 0) and np.all(np.asarray(dlhs)[total:] == 0)
    empty = np.flatnonzero(sizes == 0)
    assert empty.size and np.all(np.asarray(drhs)[empty] == 0)


def test_default_tiles_and_other_tile_shapes():
    """The Hopper default config (tiles larger than the groups), a 16-row tile and 256-row tiles with half-height
    tails give the same result."""
    lhs, rhs, gs, cot, _ = _case(None, 260, 128, 128, 6, 1, jnp.float32)
    ry, rdlhs, rdrhs = _reference(lhs, rhs, gs, cot)
    for cfg, tcfg in ((gpu_gmm.DEFAULT_CONFIG, gpu_gmm.DEFAULT_TGMM_CONFIG),
                      (TileConfig(16, 64, 32, 2, 1), TileConfig(16, 16, 128, 2, 1)),
                      (TileConfig(256, 32, 64, 4, 1, half_tail=True), SMALL_T)):     # 256-row tiles, 128-row tails
        y, dlhs, drhs = _kernel(lhs, rhs, gs, cot, cfg, tcfg)
        for a, b, what in ((y, ry, "y"), (dlhs, rdlhs, "dlhs"), (drhs, rdrhs, "drhs")):
            _close(a, b, jnp.float32, f"{what} {cfg.label()}")


def test_half_tail_tiles():
    """half_tail (visits of <= bm/2 rows run a half-height tile) equals the reference, with group sizes
    chosen so that tails of 1, bm/2 and bm/2 + 1 rows and groups smaller than half a tile all occur."""
    rng = np.random.default_rng(0)
    sizes = np.array([64 + 1, 0, 16, 17, 32 + 16, 5, 64 + 33, 12])     # bm = 32: tails 1, 16, 17, ...
    m = int(sizes.sum()) + 7
    lhs = jnp.asarray(rng.normal(size=(m, 48)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(8, 48, 80)) / 7, jnp.float32)
    cot = jnp.asarray(rng.normal(size=(m, 80)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    ry, rdlhs, rdrhs = _reference(lhs, rhs, gs, cot)
    cfg = TileConfig(32, 32, 64, 4, 2, half_tail=True)
    assert cfg.label().endswith("h")
    y, dlhs, drhs = _kernel(lhs, rhs, gs, cot, cfg, SMALL_T)
    for a, b, what in ((y, ry, "y"), (dlhs, rdlhs, "dlhs"), (drhs, rdrhs, "drhs")):
        _close(a, b, jnp.float32, f"{what} half_tail")
    assert np.all(np.asarray(y)[int(sizes.sum()):] == 0)
    with pytest.raises(ValueError, match="half_tail"):
        TileConfig(16, 32, 64, 4, 2, half_tail=True)


def test_visit_group_orders_programs_without_changing_results():
    """visit_group (program ids walk n visits per column tile) gives the same y and dlhs bit for bit as the
    plain order (each program computes the same tile), with a visit count that is not a multiple of n (the
    work list is padded with empty visits) and with half tails and folding; bad values are refused."""
    lhs, rhs, gs, cot, sizes = _case(None, 300, 64, 192, 7, 2, jnp.float32)
    for base in (SMALL, TileConfig(32, 32, 64, 4, 2, half_tail=True), TileConfig(128, 32, 64, 4, 2, fold=64)):
        ref = _kernel(lhs, rhs, gs, cot, base, SMALL_T)
        for n in (2, 4, 16):
            cfg = dataclasses.replace(base, visit_group=n)
            assert cfg.label() == base.label() + f"g{n}"
            got = _kernel(lhs, rhs, gs, cot, cfg, SMALL_T)
            for a, b, what in zip(got[:2], ref[:2], ("y", "dlhs")):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} {cfg.label()}")
    for bad in (0, 3, 32, True, 2.0):
        with pytest.raises(ValueError, match="visit_group"):
            TileConfig(visit_group=bad)


def test_all_groups_empty_gives_zeros():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.normal(size=(70, 32)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(3, 32, 48)), jnp.float32)
    gs = jnp.zeros((3,), jnp.int32)
    y, dlhs, drhs = _kernel(lhs, rhs, gs, jnp.ones((70, 48), jnp.float32))
    assert not np.any(np.asarray(y)) and not np.any(np.asarray(dlhs)) and not np.any(np.asarray(drhs))


_visits = jax.jit(gpu_gmm.make_visits, static_argnums=(1, 2, 3))


def _check_visits(sizes, m, bm, fold):
    """make_visits(sizes, m, bm, fold) against its documented invariants: every row of [0, m) in exactly
    one visit of its group (G past the sum), visits in row order and group-relative (a group's visits
    start at its first row, every bm rows), at most bm rows except a folded group's last visit (bm + r
    rows, 0 < r <= fold, after >= 1 full block; never the pseudo-group), the expected visit count,
    unused visits (G, 0, 0) at the end. Returns the table."""
    g = len(sizes)
    tab = np.asarray(_visits(jnp.asarray(sizes, jnp.int32), m, bm, fold))
    assert tab.shape == (3, gpu_gmm.num_visits(m, g, bm)) and gpu_gmm.num_visits(m, g, bm) == -(-m // bm) + g
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    used = tab[2] > tab[1]
    n_used = int(used.sum())
    assert used[:n_used].all() and np.all(tab[:, n_used:].T == (g, 0, 0))     # unused visits last
    sz = np.append(ends - starts, m - ends[-1])                                  # + the pseudo-group
    folded = (sz > bm) & (sz % bm > 0) & (sz % bm <= fold) & (np.arange(g + 1) < g)
    assert n_used == int(np.sum(-(-sz // bm)) - folded.sum())
    owner = np.full(m, -1)
    row = 0
    for grp, lo, hi in tab[:, :n_used].T:
        assert lo == row, "visits are in row order and tile the rows"
        start = starts[grp] if grp < g else ends[-1]
        assert (lo - start) % bm == 0, "row blocks are group-relative"
        if hi - lo > bm:
            assert folded[grp] and hi - lo == bm + sz[grp] % bm and hi == start + sz[grp]
        assert np.all(owner[lo:hi] == -1)              # no row is stored twice
        owner[lo:hi] = grp
        row = hi
    want = np.searchsorted(ends, np.arange(m), side="right")   # G for rows past the sum
    np.testing.assert_array_equal(owner, want)
    return tab


def test_make_visits_cover_every_row_once():
    rng = np.random.default_rng(2)
    for it in range(24):
        m, g, bm = ((300, 7, 16), (300, 7, 32), (300, 7, 128), (37, 1, 16))[it % 4]
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.ones(g) * 0.5))
        tab = _check_visits(sizes, m, bm, 0)
        assert np.all(tab[2] - tab[1] <= bm)
        for fold in (64,):
            if 2 * fold <= bm:
                _check_visits(sizes, m, bm, fold)
    # ~256 +- 16 rows per group (M2 at 8K tokens): folding remainders of <= 64 rows removes about G/2 visits
    sizes = rng.integers(240, 273, 64)
    m = int(sizes.sum())
    n_plain = int((_check_visits(sizes, m, 128, 0)[2] > 0).sum())
    n_fold = int((_check_visits(sizes, m, 128, 64)[2] > 0).sum())
    assert n_plain - n_fold == int(np.sum(sizes > 256))


def _fold_sizes(rng, bm, fold):
    """Group sizes hitting every tail-folding case, shuffled, an empty group first or last."""
    pattern = [2 * bm,                     # remainder 0
               bm + 1, bm + fold,          # remainder <= fold after one full block (1, the bound)
               3 * bm + 1, 2 * bm + fold // 2,   # ... after several full blocks
               bm + fold + 1, 2 * bm + bm - 1,   # remainder > fold: a visit of its own
               bm, bm - 1,                 # one (partial) block
               3, fold, fold - 5,          # smaller than fold / a block
               0, 0]                       # empty
    sizes = np.array(rng.permutation(pattern[:-1]).tolist(), np.int64)
    return np.insert(sizes, 0 if rng.integers(2) else len(sizes), 0)


def _fold_case(rng, sizes, m, k, n, dtype):
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    cot = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), cot


@pytest.mark.parametrize("cfg,k,n,dtype,past", [
    (TileConfig(128, 32, 64, 4, 2, fold=64), 48, 80, jnp.float32, 7),       # K, N off the tiles; rows past sum
    (TileConfig(128, 32, 64, 4, 2, fold=64), 64, 128, jnp.bfloat16, 0),     # last group folded at row M
    (TileConfig(128, 32, 64, 4, 2, fold=64, half_tail=True), 32, 64, jnp.float32, 5),   # with half tiles
])
def test_fold_matches_reference_and_fold_off(cfg, k, n, dtype, past):
    """Tail folding: forward, dlhs and drhs equal the fp32 oracle and the same tiles without folding."""
    rng = np.random.default_rng(3)
    sizes = _fold_sizes(rng, cfg.bm, cfg.fold)
    if not past:   # the last live group ends at row M with a folded remainder (loads masked at the array end)
        sizes = np.append(sizes[sizes > 0], 2 * cfg.bm + 3)
    m = int(sizes.sum()) + past
    tab = _check_visits(sizes, m, cfg.bm, cfg.fold)
    assert np.sum(tab[2] - tab[1] > cfg.bm) == 4 + (not past)    # the folded groups of the pattern
    lhs, rhs, gs, cot = _fold_case(rng, sizes, m, k, n, dtype)
    got = _kernel(lhs, rhs, gs, cot, cfg, SMALL_T)
    off = _kernel(lhs, rhs, gs, cot, dataclasses.replace(cfg, fold=0), SMALL_T)
    ref = _reference(lhs, rhs, gs, cot)
    for a, b, r, what in zip(got, off, ref, ("y", "dlhs", "drhs")):
        assert a.dtype == dtype
        _close(a, r, dtype, f"{what} {cfg.label()} vs oracle")
        # fold on / off: fp32 sums in another order; in bf16 each is within half an ulp: one ulp apart
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rtol = 2e-5 if dtype == jnp.float32 else 2.0 ** -7
        np.testing.assert_allclose(a, b, rtol=rtol, atol=2e-5 * np.abs(b).max(), err_msg=f"{what} vs fold off")
    total = int(sizes.sum())
    assert np.all(np.asarray(got[0])[total:] == 0) and np.all(np.asarray(got[1])[total:] == 0)
    empty = np.flatnonzero(sizes == 0)
    assert np.all(np.asarray(got[2])[empty] == 0)


def test_fold_single_group_and_config_errors():
    """One group (folded remainder, rows past it) vs the oracle; TileConfig rejects bad fold values."""
    rng = np.random.default_rng(4)
    cfg = TileConfig(128, 32, 64, 4, 2, fold=64)
    for size, m in ((3 * 128 + 9, 3 * 128 + 9), (128 + 64, 200), (10, 12)):
        sizes = np.array([size])
        _check_visits(sizes, m, cfg.bm, cfg.fold)
        lhs, rhs, gs, cot = _fold_case(rng, sizes, m, 32, 64, jnp.float32)
        for a, r, what in zip(_kernel(lhs, rhs, gs, cot, cfg, SMALL_T), _reference(lhs, rhs, gs, cot),
                              ("y", "dlhs", "drhs")):
            _close(a, r, jnp.float32, f"{what} single group of {size} rows, M = {m}")
    assert cfg.label() == "128x32x64w4s2fold64" and TileConfig().fold == 0
    for bad in (8, 16, 32, 96, 128, -64, 1, True, 64.0):      # < 64: wrong results on the H200 (module doc)
        with pytest.raises(ValueError, match="fold"):
            TileConfig(128, 32, 64, 4, 2, fold=bad)
    with pytest.raises(ValueError, match="fold"):
        TileConfig(64, 32, 64, 4, 2, fold=64)


def test_grouped_matmul_impl_and_errors():
    lhs, rhs, gs, _, _ = _case(None, 120, 64, 64, 4, 1, jnp.float32)
    got = grouped_matmul(lhs, rhs, gs, implementation="pallas_gpu_interpret")
    ref = grouped_matmul(lhs, rhs, gs, implementation="xla")
    assert got.dtype == jnp.float32
    _close(got, ref, jnp.float32, "grouped_matmul")
    assert registry.resolve("grouped_matmul", "auto").name == ("pallas_gpu" if jax.default_backend() == "gpu" else "xla")
    assert registry.resolve("grouped_matmul", "pallas_gpu_interpret").name == "pallas_gpu_interpret"
    if jax.default_backend() != "gpu":
        with pytest.raises(ImplementationUnavailable, match="pallas_gpu"):
            registry.resolve("grouped_matmul", "pallas_gpu")
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(bm=48)
    with pytest.raises(ValueError, match="do not fit"):                    # the op checks for users
        grouped_matmul(lhs, rhs, gs[:3], implementation="pallas_gpu_interpret")
    with pytest.raises(ValueError, match=r"lhs \[M, K\]"):
        grouped_matmul(lhs[None], rhs, gs, implementation="xla")
    with pytest.raises(ImplementationUnavailable, match="float32 / bfloat16 / float16 operands, got int32"):
        grouped_matmul(lhs.astype(jnp.int32), rhs, gs, implementation="pallas_gpu_interpret")
    with pytest.raises(AssertionError, match="groups"):                    # the kernels only assert
        gpu_gmm.gmm(lhs, rhs, gs[:3], interpret=True)
    with pytest.raises(AssertionError, match="same dtype"):
        gpu_gmm.gmm(lhs, rhs.astype(jnp.bfloat16), gs, interpret=True)


def _act(g):
    a, b = jnp.split(g.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(g.dtype)


def test_moe_layer_pallas_interpret_matches_ragged():
    """moe_experts(implementation="pallas_gpu_interpret") == "xla_ragged", forward and gradients."""
    n, h, e, i, k = 48, 32, 6, 16, 2
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (n, h), jnp.float32)
    router = jax.random.normal(ks[1], (h, e), jnp.float32)
    wi = 0.3 * jax.random.normal(ks[2], (e, h, 2 * i), jnp.float32)
    wo = 0.3 * jax.random.normal(ks[3], (e, i, h), jnp.float32)
    cot = jax.random.normal(ks[4], (n, h), jnp.float32)
    w, ex, _ = moe.route(x, router, jnp.zeros((e,)), k)

    def run(impl):
        def loss(x, wi, wo):
            return jnp.sum(moe.moe_experts(x, w, ex, wi, wo, _act, implementation=impl) * cot)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, wi, wo)

    clear_implementation_report()
    got = run("pallas_gpu_interpret")
    assert implementation_report()["moe"] == "pallas_gpu_interpret"
    with jax.default_matmul_precision("highest"):
        ref = run("xla_ragged")
    for a, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(ref), ("loss", "dx", "dwi", "dwo")):
        _close(a, b, jnp.float32, what)


def test_sorted_expert_mlp_rows_past_sum_without_mask():
    """sorted_expert_mlp skips its row mask for the Pallas kernels (zeros_past_sum): with sum(group_sizes)
    < M (expert-parallel padding rows), output and gradients equal the masked XLA path, every row compared,
    and the rows past the sum are exactly 0 in both output dtypes."""
    assert zeros_past_sum("pallas_gpu_interpret") and not zeros_past_sum("xla")
    rng = np.random.default_rng(5)
    g, h, i = 5, 32, 16
    sizes = _sizes(rng, 90, g, 1)
    m = 90
    xs = jnp.asarray(rng.normal(size=(m, h)), jnp.float32)
    wi = jnp.asarray(0.3 * rng.normal(size=(g, h, 2 * i)), jnp.float32)
    wo = jnp.asarray(0.3 * rng.normal(size=(g, i, h)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(m, h)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    total = int(sizes.sum())

    def run(impl, out_dtype):
        f = lambda xs, wi, wo: moe.sorted_expert_mlp(xs, gs, wi, wo, _act, impl, out_dtype=out_dtype)  # noqa: E731
        y, vjp = jax.vjp(f, xs, wi, wo)
        return (y, *vjp(cot.astype(y.dtype)))

    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(lambda: run("pallas_gpu_interpret", out_dtype))()
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda: run("xla", out_dtype))()
        assert got[0].dtype == out_dtype and np.all(np.asarray(got[0])[total:] == 0)
        for a, b, what in zip(got, ref, ("y", "dxs", "dwi", "dwo")):
            # both sides bf16-rounded when out_dtype is bf16 (one ulp apart at most; 4e-3 failed once in CI)
            _close(a, b, jnp.float32 if out_dtype == jnp.float32 else jnp.bfloat16, f"{what} {jnp.dtype(out_dtype)}",
                   rtol=None if out_dtype == jnp.float32 else 2.0**-7)


def test_kernels_lower_for_cuda_at_m2_shapes():
    """Forward, dlhs and tgmm lower to Triton custom calls for CUDA (M2 first projection, rhs > 4 GiB:
    64-bit offsets) on this CPU machine: default tiles, half-height tails and tail folding."""
    sd = jax.ShapeDtypeStruct
    m, kd, nd, g = 65536, 3072, 3072, 256

    for cfg in (None, TileConfig(128, 64, 256, 8, 3, half_tail=True), TileConfig(128, 64, 256, 8, 3, fold=64),
                TileConfig(128, 64, 256, 8, 4, half_tail=True, visit_group=4),
                TileConfig(256, 64, 128, 8, 3, half_tail=True)):
        def f(a, b, gs, c, cfg=cfg):
            y, vjp = jax.vjp(lambda a, b: gpu_gmm.gmm(a, b, gs, config=cfg, dlhs_config=cfg), a, b)
            return y, vjp(c)
        txt = jax.jit(f).trace(sd((m, kd), jnp.bfloat16), sd((g, kd, nd), jnp.bfloat16), sd((g,), jnp.int32),
                               sd((m, nd), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") == 3


def test_expert_parallel_path_lowers_for_cuda():
    """moe_impl="pallas_gpu" inside use_mesh (expert-parallel shard_map, check_vma on) lowers for
    CUDA with gradients: the kernels' outputs and custom-VJP cotangents are typed varying like their
    operands. The GPU backend is assumed (this machine has no GPU); nothing is run."""
    from minimax_jax import sharding as sh

    n, h, e, i, k = 64, 128, 8, 64, 2
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (n, h), jnp.bfloat16)
    wi = jax.random.normal(ks[1], (e, h, 2 * i), jnp.bfloat16)
    wo = jax.random.normal(ks[2], (e, i, h), jnp.bfloat16)
    w, ex, _ = moe.route(x, jax.random.normal(ks[3], (h, e)), jnp.zeros(e), k)
    clear_implementation_report()
    with sh.use_mesh(sh.make_mesh(f"expert={len(jax.devices())}"), sh.load_rules("default")), assume_backend("gpu"):
        def loss(x, wi, wo):
            y = moe.moe_experts(x, w, ex, wi, wo, _act, implementation="pallas_gpu", ep_transport="all_to_all")
            return jnp.sum(y.astype(jnp.float32) ** 2)
        txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, wi, wo).lower(lowering_platforms=("cuda",)).as_text()
    # 2 forward, 2 dlhs (Triton); the 2 weight gradients run the warp-specialized Mosaic GPU tgmm inside the
    # shard_map (no GPU visible: lowering for Hopper), as recorded
    assert txt.count("__gpu$xla.gpu.triton") == 4
    assert len(re.findall(r"custom_call @mosaic_gpu", txt)) == 2, re.findall(r"custom_call @\w+", txt)
    # one record per distinct choice: wi (K = h = 128) and wo (K = i = 64)
    assert implementation_report()["grouped_matmul.tgmm"] == "tgmm_ws (ws64r128x128s3); tgmm_ws (ws64r64x128s3)"


def test_sum_above_rows_is_clipped():
    """group sizes summing past M: rows beyond M are ignored (groups clipped), as documented."""
    rng = np.random.default_rng(6)
    lhs = jnp.asarray(rng.normal(size=(90, 32)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(3, 32, 48)), jnp.float32)
    gs = jnp.asarray([40, 30, 50], jnp.int32)                          # sum 120 > 90
    got = gpu_gmm.gmm_forward(lhs, rhs, gs, config=SMALL, interpret=True)
    ref = jax.lax.ragged_dot(lhs, rhs, jnp.asarray([40, 30, 20], jnp.int32), precision=HI)
    _close(got, ref, jnp.float32, "clipped")


def test_operands_varying_over_different_mesh_axes_lower_for_cuda():
    """Inside shard_map, lhs varying over one axis and rhs over another: gmm casts both to the union
    (so the custom VJP's cotangents type-check) and JAX sums the gradients over the other axis."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1, 1), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    lhs = jax.device_put(jnp.ones((256, 128), jnp.bfloat16), NamedSharding(mesh, P("a", None)))
    rhs = jax.device_put(jnp.ones((4, 128, 128), jnp.bfloat16), NamedSharding(mesh, P("b", None, None)))
    gs = jnp.asarray([64, 0, 100, 64], jnp.int32)

    def body(lhs, rhs, gs):
        return jax.grad(lambda a, b: jnp.sum(gpu_gmm.gmm(a, b, gs).astype(jnp.float32)), argnums=(0, 1))(lhs, rhs)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("a", None), P("b", None, None), P()),
                      out_specs=(P("a", None), P("b", None, None)))
    txt = jax.jit(f).trace(lhs, rhs, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 2 and "all_reduce" in txt


def test_weight_gradient_kernel_choice(monkeypatch):
    """``pallas_gpu`` picks the warp-specialized tgmm on Hopper (or with no GPU visible) where its tiles fit,
    the Triton tgmm otherwise, and records which and why under ``grouped_matmul.tgmm``."""
    from minimax_jax.ops.moe import grouped_matmul as gm
    from pallas_kernels.moe.gpu_tgmm_ws import WsTgmmConfig, ws_tgmm_config

    assert ws_tgmm_config(3072, 3072, jnp.bfloat16, 132) == WsTgmmConfig(64, 128, 256, 3, num_sms=132)
    assert ws_tgmm_config(1536, 384, jnp.float16) == WsTgmmConfig(64, 128, 128, 3)
    assert ws_tgmm_config(64, 128, jnp.float32) == "dtype float32 is not bf16 / f16"
    assert ws_tgmm_config(96, 200, jnp.bfloat16) == "K=96 is not a multiple of 64 and N=200 is not a multiple of 128"
    assert ws_tgmm_config(64, 192, jnp.bfloat16) == "N=192 is not a multiple of 128"
    lhs = jax.ShapeDtypeStruct((512, 3072), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 3072, 1536), jnp.bfloat16)
    cases = [(None, False, "tgmm_ws (ws64r128x256s3)"), ("9.0", False, "tgmm_ws (ws64r128x256s3)"),
             ("8.0", False, "triton (compute capability 8.0, not Hopper)"), ("9.0", True, "triton (interpreted)")]
    for cc, interpret, want in cases:
        monkeypatch.setattr(gm, "gpu_compute_capability", lambda cc=cc: cc)
        clear_implementation_report()
        cfg = gm._tgmm_choice(lhs, rhs, interpret)
        assert implementation_report()["grouped_matmul.tgmm"] == want
        assert (cfg is None) == want.startswith("triton")
    clear_implementation_report()
    gm._tgmm_choice(jax.ShapeDtypeStruct((512, 3072), jnp.float32), rhs, False)
    assert implementation_report()["grouped_matmul.tgmm"] == "triton (dtype float32 is not bf16 / f16)"
