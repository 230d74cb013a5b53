"""The page-union kernel of shared sparse decode tiles (``pallas_kernels.decode.gpu_union``), in Pallas
interpret mode: equal to ``common.union_pages`` (itself checked against a Python union in
``test_decode_tiles_gpu.py``) with repeats, empty slots, K not a power of two and partial row blocks; its
padding; the attention's output with either union; the op's report."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import paged
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from pallas_kernels.decode.common import union_pages
from pallas_kernels.decode.gpu_attention import paged_attention_gpu, union_choice
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LaunchTable
from pallas_kernels.decode.gpu_union import MAX_SLOTS, supports_union_kernel, union_pages_gpu


@pytest.mark.parametrize("nq,qpb,nsplit,k", [(1, 1, 1, 6), (5, 2, 3, 6), (6, 2, 4, 5), (1, 1, 16, 16),
                                             (3, 1, 2, 16), (7, 4, 3, 4), (4, 1, 8, 12)])
def test_union_kernel_equals_union_pages(nq, qpb, nsplit, k):
    rng = np.random.default_rng(nq * 1000 + qpb * 100 + nsplit * 10 + k)
    b, g = 2, 3
    ids = rng.integers(-1, 3 * k, (b, g, nq, k)).astype(np.int32)      # repeats across and inside rows, -1 slots
    want = [np.asarray(x) for x in union_pages(jnp.asarray(ids), qpb, nsplit)]
    got = [np.asarray(x) for x in union_pages_gpu(jnp.asarray(ids), qpb, nsplit, interpret=True)]
    u = qpb * k
    nblk = -(-nq // qpb)
    assert got[0].shape[:3] == got[2].shape[:3] == (b, g, nblk)
    np.testing.assert_array_equal(got[0][..., :u], want[0])
    np.testing.assert_array_equal(got[1][..., :u], want[1])
    np.testing.assert_array_equal(got[2][..., : nsplit + 1], want[2])
    assert (got[0][..., u:] == -1).all() and (got[1][..., u:] == 0).all()      # padding slots
    assert (got[2][..., nsplit + 1:] == want[2][..., -1:]).all()                # padding starts: the count


def test_union_kernel_bounds():
    assert supports_union_kernel(1, 16) and supports_union_kernel(2, 6) and supports_union_kernel(4, 4)
    assert not supports_union_kernel(8, 16) and not supports_union_kernel(2, 16)   # 128 / 32 padded slots
    assert next(q for q in range(1, 40) if not supports_union_kernel(q, 16)) * 16 > MAX_SLOTS
    with pytest.raises(ValueError, match="qpb=8"):
        union_pages_gpu(jnp.zeros((1, 1, 8, 16), jnp.int32), 8, 4)
    xla_union = dataclasses.replace(DEFAULT_TABLE, union="xla")
    assert union_choice(1, 64, 4, 16) == "kernel" and union_choice(8, 64, 4, 16) == "xla"   # M3: 16 heads / group
    assert union_choice(1, 64, 4, 16, table=xla_union) == "xla"
    assert union_choice(1, 64, 4, 16, table=dataclasses.replace(DEFAULT_TABLE, sparse_tile="per_row")) is None
    with pytest.raises(ValueError, match="union must be one of"):
        LaunchTable(union="bitmap")


@pytest.mark.parametrize("nq", [1, 3, 8])
def test_attention_is_equal_with_either_union(nq):
    """Shared sparse tiles give bit-equal o / lse whichever construction made their page union, and the op
    records which one ran."""
    rng = np.random.default_rng(nq)
    b, g, hg, d, page, npg, k = 2, 2, 4, 16, 16, 12, 4
    n_phys = b * npg + 1
    q = jnp.asarray(rng.standard_normal((b, nq, g * hg, d)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((g, n_phys, page, d)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((g, n_phys, page, d)), jnp.float32)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_phys))[: b * npg].reshape(b, npg), jnp.int32)
    pos = jnp.asarray(np.array([[100 + i for i in range(nq)], [150 + i for i in range(nq)]]), jnp.int32)
    ids = np.stack([np.stack([np.stack([rng.choice(pos[bb, i] // page, k - 1, replace=False).tolist()
                                        + [int(pos[bb, i]) // page] for i in range(nq)]) for _ in range(g)])
                    for bb in range(b)]).astype(np.int32)
    outs = {}
    for union in ("kernel", "xla"):
        table = dataclasses.replace(DEFAULT_TABLE, union=union, tile_rows=16)
        clear_implementation_report()
        outs[union] = paged.paged_attention(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids),
                                            implementation="pallas_gpu_interpret", launch_table=table)
        assert implementation_report()["paged_attention.union"] == union
        direct = paged_attention_gpu(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids), interpret=True, table=table)
        np.testing.assert_array_equal(np.asarray(direct[0]), np.asarray(outs[union][0]))
    for a, c in zip(outs["kernel"], outs["xla"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    ref = paged.paged_attention(q, kp, vp, pt, pos, block_ids=jnp.asarray(ids), implementation="xla")
    np.testing.assert_allclose(np.asarray(outs["kernel"][0]), np.asarray(ref[0]), atol=2e-5, rtol=2e-5)
