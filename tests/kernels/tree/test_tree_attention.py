"""The prefix-tree attention kernel (``pallas_kernels.tree.gpu_attention``) in Pallas interpret mode: output
and q/k/v gradients against the brute-force fp32 reference and the XLA op, every element, for packed trees
(several per row, a prefix trajectory, padding, GQA, tiles smaller and larger than the branches); the tile
lists skip sibling subtrees; the op resolves to it on GPU only for tree rows; it lowers for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.data.prefix_tree import Trajectory, pack_trajectories
from minimax_jax.ops import registry
from minimax_jax.ops.attention import attention
from minimax_jax.ops.registry import ImplementationUnavailable
from pallas_kernels.tree.gpu_attention import tile_lists, tree_attention_gpu
from tests.ops.attention.test_attention_tree import _reference


def _rows(seq_len=160, num_rows=2):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 9, size=37)
    toks = [np.concatenate([prompt, rng.integers(0, 9, size=n)]) for n in (25, 40, 0, 3, 18)]
    toks += [np.concatenate([prompt[:20], rng.integers(0, 9, size=30)]), rng.integers(0, 9, size=33)]
    return pack_trajectories([Trajectory(t, np.ones(t.size)) for t in toks], seq_len, num_rows)[0]


def _qkv(rows, h=4, g=2, d=16, dtype=jnp.float32):
    b, t = rows["tokens"].shape
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    return (jax.random.normal(kq, (b, t, h, d), dtype), jax.random.normal(kk, (b, t, g, d), dtype),
            jax.random.normal(kv, (b, t, g, d), dtype))


def _kw(rows):
    pos, seg = jnp.asarray(rows["positions"]), jnp.asarray(rows["segment_ids"])
    return dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                kv_subtree_end=jnp.asarray(rows["subtree_end"]))


@pytest.mark.parametrize("rows_per_tile,block_k", [(16, 16), (32, 64)])
def test_kernel_output_and_grads_match_reference(rows_per_tile, block_k):
    rows = _rows()
    q, k, v = _qkv(rows)
    kw = _kw(rows)

    def kern(q, k, v):
        return tree_attention_gpu(q, k, v, q_positions=kw["q_positions"], kv_positions=kw["kv_positions"],
                                  q_segment_ids=kw["q_segment_ids"], kv_segment_ids=kw["kv_segment_ids"],
                                  subtree_end=kw["kv_subtree_end"], rows=rows_per_tile, block_k=block_k,
                                  interpret=True)

    out = kern(q, k, v)
    np.testing.assert_allclose(np.asarray(out), _reference(*map(np.asarray, (q, k, v)), rows, None),
                               rtol=1e-5, atol=1e-5)
    check_grads_against_xla(kern, q, k, v, kw)


def check_grads_against_xla(kern, q, k, v, kw):
    """q / k / v gradients of ``kern(q, k, v)`` vs the fp32 XLA attention op with ``kw``, every element."""
    w = jax.random.normal(jax.random.key(5), q.shape[:3] + v.shape[3:])
    with jax.default_matmul_precision("highest"):
        g_ref = jax.grad(lambda *a: jnp.sum(attention(*a, implementation="xla", **kw) * w), (0, 1, 2))(q, k, v)
    g_ker = jax.grad(lambda *a: jnp.sum(kern(*a) * w), (0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_ref, g_ker):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max(), err_msg=f"d{name}")


def test_op_runs_the_kernel_in_bf16_and_through_auto_on_gpu():
    rows = _rows()
    q, k, v = _qkv(rows, h=8, g=2, d=32, dtype=jnp.bfloat16)
    kw = _kw(rows)
    registry.clear_implementation_report()
    out = attention(q, k, v, implementation="pallas_tree_gpu_interpret", **kw)
    assert registry.implementation_report()["attention"] == "pallas_tree_gpu_interpret"
    ref = _reference(*(np.asarray(x, np.float32) for x in (q, k, v)), rows, None)
    assert np.abs(np.asarray(out, np.float32) - ref).max() < 3e-2 * np.abs(ref).max()
    S = jax.ShapeDtypeStruct
    args = [S(x.shape, x.dtype) for x in (q, k, v)]
    with registry.assume_backend("gpu"):
        assert registry.resolve("attention", "auto", *args, sliding_window=None, chunk_size=512, **kw).name \
            == "pallas_tree_gpu"
        assert registry.resolve("attention", "auto", *args, sliding_window=8, chunk_size=512, **kw).name == "xla"
        no_tree = {x: y for x, y in kw.items() if x != "kv_subtree_end"}
        with pytest.raises(ImplementationUnavailable, match="prefix-tree rows only"):
            registry.resolve("attention", "pallas_tree_gpu", *args, sliding_window=None, chunk_size=512, **no_tree)


def test_tile_lists_skip_sibling_subtrees():
    """Two branches of 256 slots under a 128-slot prompt (tiles of 64): a query tile of the second branch
    never reaches the first branch's tiles and sees the prompt and its own earlier tiles unmasked (full);
    the first branch's tiles are reached by its own query tiles only."""
    end = np.zeros((1, 640), np.int32)
    end[0, :128] = 640                                   # the prompt: an ancestor of every slot
    end[0, 128:384] = 384                                # branch 1, a chain: its subtree closes at 384
    end[0, 384:640] = 640                                # branch 2, a chain to the end
    pos = np.r_[np.arange(384), np.arange(128, 384)].astype(np.int32)[None]
    seg = np.ones((1, 640), np.int32)
    fwd, bwd = tile_lists(*map(jnp.asarray, (end, seg, pos, seg, pos)), 640, 1, 64, 64)
    (ff, fc, pf, pc), (bf, bc, bp, bpc) = ([np.asarray(x)[0] for x in lists] for lists in (fwd, bwd))
    for r in range(6, 10):                               # query tiles of branch 2
        assert set(ff[r, :fc[r]]) | set(pf[r, :pc[r]]) <= {0, 1, 6, 7, 8, 9}
    assert set(ff[9, :fc[9]].tolist()) == {0, 1, 6, 7, 8} and set(pf[9, :pc[9]].tolist()) == {9}
    assert set(bf[3, :bc[3]].tolist()) == {4, 5} and set(bp[3, :bpc[3]].tolist()) == {3}


def test_kernel_lowers_for_cuda_forward_and_backward():
    S = jax.ShapeDtypeStruct
    b, t, h, g, d = 1, 32768, 16, 4, 128
    q, kv = S((b, t, h, d), jnp.bfloat16), S((b, t, g, d), jnp.bfloat16)
    ints = [S((b, t), jnp.int32)] * 5

    def loss(q, k, v, *ints):
        kw = dict(zip(("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids", "subtree_end"), ints))
        return jnp.sum(tree_attention_gpu(q, k, v, **kw).astype(jnp.float32))

    txt = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, *ints).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 3          # forward, dq, dk/dv


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (compiled Triton kernels)")
def test_device_kernel_matches_xla_on_an_agent_tree():
    """bf16 kernel vs the f32 XLA op on a 4K-slot tree (a 1K prompt, three levels of branches), fwd and grads."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 50, 1000)
    toks = [np.concatenate([prompt, a, b]) for a in (rng.integers(0, 50, 400), rng.integers(0, 50, 300))
            for b in (rng.integers(0, 50, 500), rng.integers(0, 50, 250), rng.integers(0, 50, 0))]
    rows = pack_trajectories([Trajectory(t, np.ones(t.size)) for t in toks], 4096, 1)[0]
    q, k, v = _qkv(rows, h=16, g=4, d=128)
    check_bf16_op_against_f32_xla("pallas_tree_gpu", q, k, v, _kw(rows))


def check_bf16_op_against_f32_xla(impl, q, k, v, kw):
    """The attention op with ``impl`` on bf16 inputs vs the f32 XLA op: value and q/k/v gradients of a
    weighted sum, within 3 % of each one's largest element."""
    w = jax.random.normal(jax.random.key(6), q.shape)

    def loss(impl, dtype):
        return lambda q, k, v: jnp.sum(attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                                 implementation=impl, **kw).astype(jnp.float32) * w)

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.value_and_grad(loss("xla", jnp.float32), (0, 1, 2)))(q, k, v)
    got = jax.jit(jax.value_and_grad(loss(impl, jnp.bfloat16), (0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() < 3e-2 * np.abs(a).max(), (np.abs(a - b).max(), np.abs(a).max())
