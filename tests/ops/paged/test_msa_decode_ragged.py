"""``msa_decode`` on ragged batches in a wide page table through the GPU kernels (Pallas interpret mode).

Traced positions (the ``"sparse"`` path, no run-time branch): one batch mixes requests of K*B - 1, K*B
and K*B + 1 tokens with a long one and a padding request, in a page table far wider than K pages, for Q
in {1, 8, 16} and the shared / legacy attention tilings. Against the XLA reference composition every
element (ids as sets); short rows' ids are exactly ``0..local`` (no ranking) and their outputs equal
dense ``paged_attention``; the kernels record that short rows go unscored.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from minimax_jax.ops import paged as ops
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LEGACY_TILES
from tests.ops.paged.test_decode_oracle import K, PAGE
from tests.ops.paged.test_msa_decode_paths import KB, _args, _case, _check

IMPL = "pallas_gpu_interpret"


def _msa(table):
    def f(q, qi, k, v, ki, pt, pos, k_scale, v_scale, ki_scale):
        return ops.msa_decode(q, qi, k, v, ki, pt, pos, k_scale=k_scale, v_scale=v_scale, ki_scale=ki_scale,
                              topk=K, implementation=IMPL, launch_table=table)
    return jax.jit(f)


@pytest.mark.parametrize("nq,tiles,dtype", [(1, "shared", "float32"), (8, "shared", "float32"),
                                            (16, "shared", "float32"),
                                            (8, "legacy", "float32"), (8, "shared", "float8_e4m3fn")])
def test_ragged_boundaries_in_a_wide_table(nq, tiles, dtype):
    table = {"shared": DEFAULT_TABLE, "legacy": LEGACY_TILES}[tiles]
    contexts = (KB - 1, KB, KB + 1, 30 * PAGE + 5, None, KB + 2 * PAGE)
    c = _case(nq, contexts, dtype=dtype, npg=32)                        # 32 pages wide, K = 4
    clear_implementation_report()
    o, lse, ids = _msa(table)(*_args(c))
    rep = implementation_report()
    assert rep["msa_decode.path"] == "sparse" and rep["msa_decode_select.short_rows"] == "unscored"
    tol = 1e-4 if dtype == "float32" else 2e-2
    _check(c, (o, lse, ids), tol=tol)
    pos = np.asarray(c["pos"])
    local = np.where(pos >= 0, pos // PAGE, -1)
    short = local < K                                                   # [B, Q]
    slot = np.arange(K)
    want = np.where(slot <= local[..., None], slot, -1)                 # [B, Q, K]
    ids = np.asarray(ids)
    for g in range(ids.shape[1]):
        np.testing.assert_array_equal(ids[:, g][short], want[short])
    o_d, lse_d = jax.jit(lambda *a: ops.paged_attention(*a[:5], k_scale=a[5], v_scale=a[6], implementation=IMPL,
                                                        launch_table=table))(
        c["q"], c["k"], c["v"], c["table"], c["pos"], c["k_scale"], c["v_scale"])
    tol = 1e-5 if dtype == "float32" else 2e-2                          # bf16 products: other split rounding
    np.testing.assert_allclose(np.asarray(o)[short], np.asarray(o_d)[short], atol=tol, rtol=tol)
    fin = np.isfinite(np.asarray(lse_d)) & short[..., None]
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_d)[fin], atol=tol, rtol=tol)
    assert short.sum() >= 2 * nq and (~short & (pos >= 0)).sum() >= 2 * nq      # both kinds of rows present
