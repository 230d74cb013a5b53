"""``masked_attention_gpu`` (the tree kernels without a tree: queries any subset of the keys, visibility by
segments and positions) in Pallas interpret mode: output and q/k/v gradients against the XLA attention op,
every element, for a context-parallel shard's queries (two zig-zag chunks of a packed row, T != S) against
all keys, with padding keys and rows that see no key; its tile lists skip the key tiles no query can see."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import registry
from minimax_jax.ops.attention import attention
from pallas_kernels.tree.gpu_attention import masked_attention_gpu, position_tile_lists
from tests.kernels.tree.test_tree_attention import check_bf16_op_against_f32_xla, check_grads_against_xla


def _case(s=192, chunks=8, shard=1, h=4, g=2, d=16, dtype=jnp.float32):
    """Keys: one packed row of three documents (positions restart per document) and padding; queries: the
    zig-zag shard ``shard`` of ``chunks // 2`` (chunks ``shard`` and ``chunks - 1 - shard``)."""
    lens = [70 * s // 192, 50 * s // 192, 60 * s // 192]                  # 70 / 50 / 60 at the default s
    pad = s - sum(lens)
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(lens)] + [np.full(pad, -1)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens] + [np.zeros(pad)]).astype(np.int32)
    c = s // chunks
    idx = np.concatenate([np.arange(shard * c, (shard + 1) * c),
                          np.arange((chunks - 1 - shard) * c, (chunks - shard) * c)])
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(kq, (1, idx.size, h, d), dtype)
    k = jax.random.normal(kk, (1, s, g, d), dtype)
    v = jax.random.normal(kv, (1, s, g, d), dtype)
    kw = dict(q_positions=jnp.asarray(pos[idx])[None], kv_positions=jnp.asarray(pos)[None],
              q_segment_ids=jnp.asarray(seg[idx])[None], kv_segment_ids=jnp.asarray(seg)[None])
    return q, k, v, kw


@pytest.mark.parametrize("shard,rows,block_k", [(1, 16, 16), (3, 32, 64), (0, 128, 32)])
def test_output_and_grads_match_the_xla_op(shard, rows, block_k):
    q, k, v, kw = _case(shard=shard)

    def kern(q, k, v):
        return masked_attention_gpu(q, k, v, rows=rows, block_k=block_k, interpret=True, **kw)

    with jax.default_matmul_precision("highest"):
        ref = attention(q, k, v, implementation="xla", **kw)
    np.testing.assert_allclose(np.asarray(kern(q, k, v)), np.asarray(ref), rtol=1e-5, atol=1e-5)
    check_grads_against_xla(kern, q, k, v, kw)


def test_tile_lists_cover_every_visible_pair_and_skip_most_others():
    """Every (query tile, key tile) pair with a visible (row, key) is listed; FULL pairs are wholly
    visible; a query tile of one segment walks no tile of other segments or later positions (a tile whose
    rows span segments, here the zig-zag seam, is conservative); fewer pairs walked than exist."""
    q, k, v, kw = _case(shard=0)
    rows, block_k, rep = 32, 16, 2
    row_seg = jnp.repeat(kw["q_segment_ids"], rep, axis=1)
    row_pos = jnp.repeat(kw["q_positions"], rep, axis=1)
    (fids, fcnt, pids, pcnt), _ = position_tile_lists(kw["kv_segment_ids"], kw["kv_positions"], row_seg, row_pos,
                                                      rows, block_k)
    fids, fcnt, pids, pcnt = (np.asarray(x)[0] for x in (fids, fcnt, pids, pcnt))
    ks, kp = np.asarray(kw["kv_segment_ids"])[0], np.asarray(kw["kv_positions"])[0]
    qs, qp = np.asarray(row_seg)[0], np.asarray(row_pos)[0]
    vis = (ks[None, :] == qs[:, None]) & (ks[None, :] >= 0) & (kp[None, :] <= qp[:, None])
    nq, nk = qs.size // rows, ks.size // block_k
    tiles = vis.reshape(nq, rows, nk, block_k)
    walked = need = 0
    for r in range(nq):
        full, part = set(fids[r, :fcnt[r]].tolist()), set(pids[r, :pcnt[r]].tolist())
        needed = {c for c in range(nk) if tiles[r, :, c].any()}
        assert needed <= full | part and not full & part
        assert all(tiles[r, :, c].all() for c in full)
        walked += len(full | part)
        need += len(needed)
        valid = qs[r * rows:(r + 1) * rows] >= 0
        if len(set(qs[r * rows:(r + 1) * rows][valid])) == 1:
            seg = qs[r * rows:(r + 1) * rows][valid][0]
            mixed = {c for c in range(nk) if len(set(ks[c * block_k:(c + 1) * block_k])) > 1}
            assert full | part <= needed | {c for c in mixed if seg in ks[c * block_k:(c + 1) * block_k]}
    assert need <= walked < nq * nk


def test_kernel_lowers_for_cuda_forward_and_backward_at_local_shapes():
    """A sequence=8 shard of a 64K row: 8K local queries against 64K gathered keys, bf16, M3-like heads."""
    S = jax.ShapeDtypeStruct
    b, t, s, h, g, d = 1, 8192, 65536, 16, 4, 128
    q, kv = S((b, t, h, d), jnp.bfloat16), S((b, s, g, d), jnp.bfloat16)
    qi, ki = S((b, t), jnp.int32), S((b, s), jnp.int32)

    def loss(q, k, v, qp, qs, kp, ks):
        o = masked_attention_gpu(q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks)
        return jnp.sum(o.astype(jnp.float32))

    txt = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, qi, qi, ki, ki).lower(
        lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 3          # forward, dq, dk/dv


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (compiled Triton kernels)")
def test_device_kernel_matches_xla_on_a_context_parallel_shard():
    """bf16 kernel (through the op's ``auto``: T != S on GPU) vs the f32 XLA op: shard 1 of 4 (zig-zag) of a
    4K packed row against all 4K keys, fwd and grads."""
    q, k, v, kw = _case(s=4096, chunks=8, shard=1, h=16, g=4, d=128)
    registry.clear_implementation_report()
    check_bf16_op_against_f32_xla("auto", q, k, v, kw)
    assert registry.implementation_report()["attention"] == "pallas_masked_gpu"
