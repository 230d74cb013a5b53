"""GPU indexer-KL kernels (interpret mode) against the XLA reference (minimax_jax.ops.msa.kl): loss,
row count, gradients wrt qi and ki (cosine and max error), zero gradient to q and k, determinism,
cuda lowering; the unsupported paths raise (ImplementationUnavailable through the op)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops.registry import ImplementationUnavailable
from pallas_kernels.msa.gpu_kl import indexer_kl_gpu
from tests.kernels.msa.test_msa_kernels_oracle import cosine, make_case, positions, random_ids

BLK = 16


def _loss_and_grads(fn, c, ids, qi, ki, ct, repeats=1):
    """(kl, count, (dq, dk, dqi, dki)) of fn under jit; repeats > 1 runs the compiled function again
    and returns a list (for bitwise-determinism checks)."""
    pos = positions(c)

    def f(q, k, qi, ki):
        return fn(q, k, qi, ki, jnp.asarray(ids), block_size=BLK, **pos)

    @jax.jit
    def run(q, k, qi, ki):
        (kl, cnt), vjp = jax.vjp(f, q, k, qi, ki)
        return kl, cnt, vjp((jnp.float32(ct), np.zeros((), jax.dtypes.float0)))
    args = (jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(qi), jnp.asarray(ki))
    if repeats > 1:
        return [run(*args) for _ in range(repeats)]
    return run(*args)


def test_kl_matches_reference_packed():
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=2, t=40, s=40, h=6, g=2, d=16, segments=[[13, 20, 5], [40]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    qi = rng.standard_normal((2, 40, 2, 16)).astype(np.float32)
    ki = rng.standard_normal((2, 40, 16)).astype(np.float32)
    ct = float(rng.uniform(0.5, 2.0))
    kern = lambda *a, **kw: msa_ops.indexer_kl(*a, implementation="pallas_gpu_interpret", **kw)
    ref = lambda *a, **kw: msa_ops.indexer_kl(*a, implementation="xla", **kw)
    (kl, cnt, g), (kl2, _, g2) = _loss_and_grads(kern, c, ids, qi, ki, ct, repeats=2)
    rkl, rcnt, rg = _loss_and_grads(ref, c, ids, qi, ki, ct)
    assert int(cnt) == int(rcnt)
    np.testing.assert_allclose(float(kl), float(rkl), rtol=1e-5)
    assert not np.any(np.asarray(g[0])) and not np.any(np.asarray(g[1]))   # q, k untouched
    for a, b in zip(g[2:], rg[2:]):
        a, b = np.asarray(a), np.asarray(b)
        assert cosine(a, b) > 0.9999
        assert np.max(np.abs(a - b)) <= 1e-4 * np.abs(b).max()
    assert float(kl2) == float(kl)
    for a, b in zip(g2[2:], g[2:]):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_kl_unsupported_paths_raise():
    z = jnp.zeros((1, 4, 2, 16))
    kw = dict(q_positions=jnp.zeros((1, 4), jnp.int32), kv_positions=jnp.arange(4)[None],
              block_size=BLK)
    with pytest.raises(ValueError, match="dense warm-up"):
        indexer_kl_gpu(z, jnp.zeros((1, 4, 2, 16)), z, jnp.zeros((1, 4, 16)), None, **kw)
    # the dense warm-up (no block ids) has no TPU kernel (the GPU implementations run gpu_kl_dense:
    # tests/kernels/msa/test_msa_kernels_kl_dense.py)
    with pytest.raises(ImplementationUnavailable, match="dense warm-up"):
        msa_ops.indexer_kl(z, jnp.zeros((1, 4, 2, 16)), z, jnp.zeros((1, 4, 16)),
                           None, implementation="pallas_tpu_interpret", **kw)


def test_kl_lowers_for_cuda():
    sd = jax.ShapeDtypeStruct
    b, t, h, g, d = 1, 512, 16, 2, 128

    def f(q, k, qi, ki, ids, pos):
        loss = lambda qi, ki: indexer_kl_gpu(q, k, qi, ki, ids, q_positions=pos,
                                             kv_positions=pos, block_size=128)[0]
        return jax.grad(loss, argnums=(0, 1))(qi, ki)
    txt = jax.jit(f).trace(sd((b, t, h, d), jnp.bfloat16), sd((b, t, g, d), jnp.bfloat16),
                           sd((b, t, g, 128), jnp.bfloat16), sd((b, t, 128), jnp.bfloat16),
                           sd((b, g, t, 4), jnp.int32), sd((b, t), jnp.int32)
                           ).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("triton") >= 3


def test_model_sparse_kl_follows_msa_impl():
    """The model's sparse indexer KL runs the implementation of ``cfg.msa_impl`` (it ran the fp32 XLA
    reference whatever msa_impl said: O(T^2), ~475 TFLOP per step of bench/train_step.py at 64K):
    same KL and index-projection gradients as msa_impl="xla"; the dense warm-up KL follows it too (the dense GPU
    kernels, pallas_kernels/msa/gpu_kl_dense.py)."""
    from minimax_jax.config import load_config
    from minimax_jax.model import forward, init_params
    from minimax_jax.ops.registry import clear_implementation_report, implementation_report

    base = load_config("tiny-m3")
    params = init_params(base, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 96), 0, base.vocab_size)   # 6 blocks, top-4
    segs = jnp.asarray((np.arange(96) >= 37).astype(np.int32))[None]               # 2 packed documents
    pos = jnp.asarray(np.where(np.arange(96) >= 37, np.arange(96) - 37, np.arange(96)).astype(np.int32))[None]

    def run(impl, mode="sparse", trace_only=False):
        cfg = base.replace(msa_impl=impl)

        def kl(p):
            out = forward(p, cfg, tokens, positions=pos, segment_ids=segs, indexer_kl=mode, return_msa=True)
            return out.aux["indexer_kl_sum"], (out.aux["indexer_kl_count"], out.aux["msa"])
        clear_implementation_report()     # recorded while tracing (a fresh jit per call traces anew)
        fn = jax.jit(jax.value_and_grad(kl, has_aux=True))
        if trace_only:                    # the routing is decided while tracing: no compile needed
            fn.trace(params)
            return implementation_report()
        (val, (cnt, msa)), grads = fn(params)
        return val, cnt, msa, grads, implementation_report()

    val, cnt, msa, grads, rep = run("pallas_gpu_interpret")
    assert rep["indexer_kl"] == "pallas_gpu_interpret", rep
    rval, rcnt, rmsa, rgrads, rrep = run("xla")
    assert rrep["indexer_kl"] == "xla"
    for a, b in zip(msa, rmsa):             # same selections, so the KL must agree
        assert np.array_equal(np.asarray(a["block_ids"]), np.asarray(b["block_ids"]))
    assert float(cnt) == float(rcnt)
    np.testing.assert_allclose(float(val), float(rval), rtol=1e-4)
    n = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(rgrads)):
        if "index_" in jax.tree_util.keystr(path) and np.abs(np.asarray(b)).max() > 0:
            assert cosine(np.asarray(a), np.asarray(b)) > 0.999, jax.tree_util.keystr(path)
            n += 1
    assert n >= 2
    rep = run("pallas_gpu_interpret", mode="dense", trace_only=True)
    assert rep["indexer_kl"] == "pallas_gpu_interpret"


def _packed_case(seed):
    """(q, k, qi, ki, ids, positions) of two packed rows, 6 heads in 2 groups, top-3 blocks."""
    rng = np.random.default_rng(seed)
    c = make_case(rng, bsz=2, t=40, s=40, h=6, g=2, d=16, segments=[[13, 20, 5], [40]])
    ids = jnp.asarray(random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK))
    qi = jnp.asarray(rng.standard_normal((2, 40, 2, 16)).astype(np.float32))
    ki = jnp.asarray(rng.standard_normal((2, 40, 16)).astype(np.float32))
    return jnp.asarray(c["q"]), jnp.asarray(c["k"]), qi, ki, ids, positions(c)


@pytest.mark.parametrize("with_lse", [True, False])
def test_kl_token_tiles_with_a_head_loop_match_the_reference(with_lse):
    """The KL pass's token tiles (the teacher's 3 heads per group in a loop) give the XLA reference's KL, count
    and gradients (packed documents, masked and mask-free tiles), with the teacher's LSE given or computed."""
    q, k, qi, ki, ids, pos = _packed_case(5)
    lse = msa_ops.msa_attention(q, k, k, ids, block_size=BLK, implementation="xla", **pos)[1] if with_lse else None

    def kl(impl):
        kw = dict(teacher_lse=lse) if impl != "xla" else {}
        f = lambda qi, ki: msa_ops.indexer_kl(q, k, qi, ki, ids, block_size=BLK, implementation=impl, **pos, **kw)
        (val, cnt), vjp = jax.vjp(f, qi, ki)
        return val, cnt, vjp((jnp.float32(1.0), np.zeros((), jax.dtypes.float0)))

    (a, ca, ga), (b, cb, gb) = kl("pallas_gpu_interpret"), kl("xla")
    assert int(ca) == int(cb) and int(ca) > 0
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(y)).max())
        assert np.abs(np.asarray(y)).max() > 0


def test_kl_with_the_attention_lse_skips_the_teacher_pass_and_agrees():
    """``teacher_lse`` = msa_attention's LSE over the same support: the same KL and gradients as the kernel
    computing it (and as the reference), and the kernel's first pass no longer computes main-branch logits."""
    q, k, qi, ki, ids, pos = _packed_case(3)
    _, lse = msa_ops.msa_attention(q, k, k, ids, block_size=BLK, implementation="xla", **pos)

    def kl(impl, **kw):
        f = lambda qi, ki: msa_ops.indexer_kl(q, k, qi, ki, ids, block_size=BLK, implementation=impl, **pos, **kw)[0]
        return jax.value_and_grad(f, (0, 1))(qi, ki)

    (a, ga), (b, gb), (r, gr) = kl("pallas_gpu_interpret", teacher_lse=lse), kl("pallas_gpu_interpret"), kl("xla")
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    np.testing.assert_allclose(float(a), float(r), rtol=1e-5)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(y)).max())
    for x, y in zip(ga, gr):        # and the kernel's gradients against the XLA reference's
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(y)).max())
    f = lambda qi, ki, lse: indexer_kl_gpu(q, k, qi, ki, ids, block_size=BLK, teacher_lse=lse, **pos)[0]
    txt = jax.jit(f).trace(qi, ki, lse).lower(lowering_platforms=("cuda",)).as_text()
    assert "msa_kl_student_lse_gpu" in txt and "msa_kl_lse_gpu" not in txt.replace("msa_kl_student_lse_gpu", "")
    with pytest.raises(ValueError, match="teacher_lse must have shape"):
        kl("xla", teacher_lse=lse[:, :, :3])
