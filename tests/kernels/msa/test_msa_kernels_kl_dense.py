"""Dense warm-up indexer-KL GPU kernels (``pallas_kernels.msa.gpu_kl_dense``, interpret mode) against the fp32 XLA
reference (``minimax_jax.ops.msa.kl.indexer_kl`` with ``block_ids=None``): KL sum, row count and every element
of d qi / d ki for packed causal documents with empty slots, queries as a suffix of the keys, prefix-tree rows
(``kv_subtree_end``), per-query weights, tiles that do not divide T or S and several heads per group; zero
gradient to q / k and bitwise repeatability; the public op runs it for ``block_ids=None`` on the GPU
implementations (the TPU ones still refuse); it lowers for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.data.prefix_tree import Trajectory, pack_trajectories
from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops import registry
from minimax_jax.ops.msa.kl import indexer_kl as kl_reference
from minimax_jax.ops.registry import ImplementationUnavailable
from pallas_kernels.msa.gpu_kl_dense import indexer_kl_dense_gpu
from pallas_kernels.tree.gpu_attention import position_tile_lists
from tests.kernels.msa.test_msa_kernels_oracle import make_case, positions

_F0 = np.zeros((), jax.dtypes.float0)


def _cot(ct, weighted):
    """Cotangent of (kl_sum, count): the count is int32 (float0 cotangent), float32 with q_weights."""
    return jnp.float32(ct), (jnp.float32(0.0) if weighted else _F0)


def _reference(q, k, qi, ki, kw, ct, q_weights=None):
    """(kl, count, (dqi, dki)) of the fp32 XLA reference for cotangent ``ct``."""
    def f(qi, ki):
        return kl_reference(q, k, qi, ki, None, kw["q_positions"], kw["kv_positions"], kw["q_segment_ids"],
                            kw["kv_segment_ids"], block_size=None, chunk_size=16,
                            kv_subtree_end=kw.get("kv_subtree_end"), q_weights=q_weights)
    (kl, cnt), vjp = jax.vjp(f, qi, ki)
    return kl, cnt, vjp(_cot(ct, q_weights is not None))


def _kernel(q, k, qi, ki, kw, ct, q_weights=None, **tiling):
    """(kl, count, (dq, dk, dqi, dki)) of the interpreted kernels under jit for cotangent ``ct``."""
    @jax.jit
    def run(q, k, qi, ki):
        f = lambda *a: indexer_kl_dense_gpu(*a, q_weights=q_weights, interpret=True, **kw, **tiling)  # noqa: E731
        (kl, cnt), vjp = jax.vjp(f, q, k, qi, ki)
        return kl, cnt, vjp(_cot(ct, q_weights is not None))
    return run(q, k, qi, ki)


def _check(q, k, qi, ki, kw, q_weights=None, repeat=False, **tiling):
    ct = 1.7
    kl, cnt, grads = _kernel(q, k, qi, ki, kw, ct, q_weights, **tiling)
    rkl, rcnt, rgrads = _reference(q, k, qi, ki, kw, ct, q_weights)
    assert cnt.dtype == rcnt.dtype and float(cnt) == float(rcnt) and float(rcnt) > 0
    np.testing.assert_allclose(float(kl), float(rkl), rtol=1e-5)
    assert not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1]))       # q, k get no gradient
    for name, a, b in zip(("d qi", "d ki"), grads[2:], rgrads):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=name)
    if repeat:                                                   # no atomics: bitwise repeatable
        again = _kernel(q, k, qi, ki, kw, ct, q_weights, **tiling)
        assert float(again[0]) == float(kl)
        for a, b in zip(again[2][2:], grads[2:]):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def _index(rng, b, t, s, g, di):
    return (jnp.asarray(rng.standard_normal((b, t, g, di)), jnp.float32),
            jnp.asarray(rng.standard_normal((b, s, di)), jnp.float32))


@pytest.mark.parametrize("weighted", [False, True])
def test_dense_kl_packed_documents_match_reference(weighted):
    """Two rows: three packed documents and two empty slots (rows with an empty support count 0), one document;
    3 heads per group; 16-query / 32-key tiles over T = S = 40 (neither divides it)."""
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=2, t=40, s=40, h=6, g=2, d=16, segments=[[13, 20, 5], [40]])
    qi, ki = _index(rng, 2, 40, 40, 2, 16)
    w = jnp.asarray(rng.integers(0, 4, (2, 40)), jnp.float32) if weighted else None
    _check(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, positions(c), q_weights=w, repeat=not weighted,
           block_q=16, block_k=32)


def test_dense_kl_queries_a_suffix_of_the_keys():
    """T = 40 queries, the last of S = 64 keys (a chunk after its context), two documents; 16 x 16 tiles, some
    FULL (walked without a mask), some partial."""
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=1, t=40, s=64, h=4, g=1, d=32, segments=[[9, 55]])
    qi, ki = _index(rng, 1, 40, 64, 1, 16)
    pad = lambda x, n: np.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=-1)       # noqa: E731
    (_, full, _, part), _ = position_tile_lists(jnp.asarray(c["kv_seg"]), jnp.asarray(c["kv_pos"]),
                                                jnp.asarray(pad(c["q_seg"], 48)), jnp.asarray(pad(c["q_pos"], 48)),
                                                16, 16)
    assert int(full.sum()) > 0 and int(part.sum()) > 0
    _check(jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, positions(c), block_q=16, block_k=16)


def _tree_rows():
    """Two rows of prefix trees: a 37-token prompt with branches, a branch off its 20th token, a lone trajectory."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 9, size=23)
    toks = [np.concatenate([prompt, rng.integers(0, 9, size=n)]) for n in (17, 9, 0, 3)]
    toks += [np.concatenate([prompt[:12], rng.integers(0, 9, size=14)]), rng.integers(0, 9, size=21)]
    return pack_trajectories([Trajectory(t, np.ones(t.size)) for t in toks], 72, 2)[0]


def _tree_case(seed, h, g):
    """(rows, rng, (q, k, qi, ki, op keywords)) over ``_tree_rows`` with h q heads, g kv groups, dims 16."""
    rows = _tree_rows()
    b, t = rows["tokens"].shape
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, g, 16)), jnp.float32)
    qi, ki = _index(rng, b, t, t, g, 16)
    pos, seg = jnp.asarray(rows["positions"]), jnp.asarray(rows["segment_ids"])
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
              kv_subtree_end=jnp.asarray(rows["subtree_end"]))
    return rows, rng, (q, k, qi, ki, kw)


def test_dense_kl_prefix_tree_rows_with_weights_match_reference():
    """Prefix-tree visibility (``kv_subtree_end``: siblings invisible, tiles of sibling subtrees skipped) with
    the rows' input weights as q_weights (the model's merged KL rows)."""
    rows, rng, (q, k, qi, ki, kw) = _tree_case(4, h=4, g=2)
    b, t = rows["tokens"].shape
    w = jnp.asarray(rows["input_weight"], jnp.float32) + jnp.asarray(rng.uniform(0, 1, (b, t)), jnp.float32)
    _check(q, k, qi, ki, kw, q_weights=w, block_q=16, block_k=16)


def _packed():
    rng = np.random.default_rng(5)
    c = make_case(rng, bsz=1, t=40, s=40, h=4, g=2, d=16, segments=[[17, 23]])
    qi, ki = _index(rng, 1, 40, 40, 2, 16)
    return jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, positions(c)


def test_public_op_runs_the_dense_kernel_on_gpu_implementations():
    """``indexer_kl(..., block_ids=None)``: "pallas_gpu_interpret" runs the dense kernels (reported as such, the
    reference's KL and gradients), "auto" on a GPU resolves to "pallas_gpu", the TPU kernels still refuse with
    the dense warm-up named, and tiny head dims are refused with the reason."""
    q, k, qi, ki, pos = _packed()

    def run(impl):
        f = lambda qi, ki: msa_ops.indexer_kl(q, k, qi, ki, None, implementation=impl, **pos)  # noqa: E731
        registry.clear_implementation_report()
        (kl, cnt), vjp = jax.vjp(f, qi, ki)
        return kl, cnt, vjp((jnp.float32(1.0), _F0)), registry.implementation_report()["indexer_kl"]

    kl, cnt, g, ran = run("pallas_gpu_interpret")
    rkl, rcnt, rg, rran = run("xla")
    assert (ran, rran) == ("pallas_gpu_interpret", "xla")
    assert int(cnt) == int(rcnt) == 80
    np.testing.assert_allclose(float(kl), float(rkl), rtol=1e-5)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(b)).max())
    with registry.assume_backend("gpu"):
        assert registry.resolve("indexer_kl", "auto", q, k, qi, ki, None, chunk_size=256, block_size=None,
                                **pos).name == "pallas_gpu"
    with pytest.raises(ImplementationUnavailable, match="dense warm-up"):
        msa_ops.indexer_kl(q, k, qi, ki, None, implementation="pallas_tpu_interpret", **pos)
    with registry.assume_backend("tpu"), pytest.raises(ImplementationUnavailable, match="dense warm-up"):
        registry.resolve("indexer_kl", "pallas_tpu", q, k, qi, ki, None, chunk_size=256, block_size=None, **pos)
    with pytest.raises(ImplementationUnavailable, match="head dim D must be a power of two"):
        msa_ops.indexer_kl(q[..., :8], k[..., :8], qi, ki, None, implementation="pallas_gpu_interpret", **pos)


def test_public_op_dense_tree_rows_run_the_kernel():
    """Prefix-tree rows through the op: the dense GPU KL serves kv_subtree_end (the sparse kernels refuse it)."""
    _, _, (q, k, qi, ki, kw) = _tree_case(6, h=2, g=1)
    registry.clear_implementation_report()
    kl, cnt = msa_ops.indexer_kl(q, k, qi, ki, None, implementation="pallas_gpu_interpret", **kw)
    assert registry.implementation_report()["indexer_kl"] == "pallas_gpu_interpret"
    rkl, rcnt = msa_ops.indexer_kl(q, k, qi, ki, None, implementation="xla", **kw)
    assert int(cnt) == int(rcnt)
    np.testing.assert_allclose(float(kl), float(rkl), rtol=1e-5)


def test_dense_kl_bad_arguments_raise():
    q, k, qi, ki, pos = _packed()
    with pytest.raises(ValueError, match="block_q / block_k must be powers of two"):
        indexer_kl_dense_gpu(q, k, qi, ki, block_q=24, interpret=True, **pos)
    with pytest.raises(ValueError, match="q / k must share one dtype"):
        indexer_kl_dense_gpu(q.astype(jnp.bfloat16), k, qi, ki, interpret=True, **pos)
    with pytest.raises(ValueError, match="kv_subtree_end needs T == S"):
        indexer_kl_dense_gpu(q[:, :8], k, qi[:, :8], ki, q_positions=pos["q_positions"][:, :8],
                             kv_positions=pos["kv_positions"], kv_subtree_end=pos["kv_positions"] + 1)


def test_dense_kl_lowers_for_cuda():
    """Value and gradients at an M3-like group (16 heads of D = 128 per group, Di = 128, bf16), plain and
    prefix-tree weighted rows: Pallas lowers all three kernels to Triton (the final compile needs a GPU)."""
    sd = jax.ShapeDtypeStruct
    b, t, h, g, d = 1, 256, 32, 2, 128
    for tree in (False, True):
        def f(q, k, qi, ki, pos, end, w):
            def loss(qi, ki):
                return indexer_kl_dense_gpu(q, k, qi, ki, q_positions=pos, kv_positions=pos,
                                            kv_subtree_end=end if tree else None, q_weights=w if tree else None)[0]
            return jax.grad(loss, argnums=(0, 1))(qi, ki)
        txt = jax.jit(f).trace(sd((b, t, h, d), jnp.bfloat16), sd((b, t, g, d), jnp.bfloat16),
                               sd((b, t, g, 128), jnp.bfloat16), sd((b, t, 128), jnp.bfloat16),
                               sd((b, t), jnp.int32), sd((b, t), jnp.int32), sd((b, t), jnp.float32)
                               ).lower(lowering_platforms=("cuda",)).as_text()
        for name in ("msa_kl_dense_lse_gpu", "msa_kl_dense_rows_gpu", "msa_kl_dense_keys_gpu"):
            assert name in txt, (tree, name)
        assert txt.count("__gpu$xla.gpu.triton") == 4          # teacher LSE, student LSE, rows, keys


@pytest.mark.slow      # ~10 s: the routing alone is in the default run (test_msa_kernels_kl.py's model test)
def test_model_dense_warmup_kl_runs_the_kernels_and_matches_xla():
    """The model's dense warm-up KL follows ``cfg.msa_impl`` (``msa_block._dense_kl_impl``): tiny M3 on two packed
    documents gives the XLA reference's KL, count and index-projection gradients through the interpreted kernels."""
    from minimax_jax.config import load_config
    from minimax_jax.model import forward, init_params
    from tests.kernels.msa.test_msa_kernels_oracle import cosine

    base = load_config("tiny-m3")
    params = init_params(base, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 96), 0, base.vocab_size)
    segs = jnp.asarray((np.arange(96) >= 37).astype(np.int32))[None]
    pos = jnp.asarray(np.where(np.arange(96) >= 37, np.arange(96) - 37, np.arange(96)).astype(np.int32))[None]

    def run(impl):
        cfg = base.replace(msa_impl=impl)

        def kl(p):
            out = forward(p, cfg, tokens, positions=pos, segment_ids=segs, indexer_kl="dense")
            return out.aux["indexer_kl_sum"], out.aux["indexer_kl_count"]
        registry.clear_implementation_report()
        (val, cnt), grads = jax.jit(jax.value_and_grad(kl, has_aux=True))(params)
        return val, cnt, grads, registry.implementation_report()["indexer_kl"]

    val, cnt, grads, ran = run("pallas_gpu_interpret")
    rval, rcnt, rgrads, rran = run("xla")
    assert (ran, rran) == ("pallas_gpu_interpret", "xla")
    assert float(cnt) == float(rcnt) > 0
    np.testing.assert_allclose(float(val), float(rval), rtol=1e-5)
    n = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(rgrads)):
        if np.abs(np.asarray(b)).max() > 0:
            assert "index_" in jax.tree_util.keystr(path) and cosine(np.asarray(a), np.asarray(b)) > 0.99999
            n += 1
    assert n >= 2
