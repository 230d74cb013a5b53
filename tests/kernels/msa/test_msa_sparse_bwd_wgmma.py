"""The Hopper (Mosaic GPU) KV-outer MSA backward (pallas_kernels/msa/gpu_sparse_bwd_wgmma.py).

In the Mosaic GPU interpreter (jax >= 0.11; skipped with the reason on older jax), dq / dk / dv against the
gradient of the fp32 XLA reference (``minimax_jax.ops.msa``, implementation "xla", on the same bf16-rounded
inputs), every element (max |error| <= 5 % of max |reference|, cosine > 0.99: the bf16 tolerance of the
Triton backward's tests): causal self-attention, packed documents of 8-row aligned lengths, queries as a
suffix of the keys, runs split over programs (small ``chunk``), 8 and 16 heads per group, 6 heads in 8-row
head slots, f32 and bf16 dq partials; a pass with an unaligned window runs the Triton kernel; the ops
layer's default, ``hopper_backward`` and its report. On any jax: the CUDA
lowering at M3 shapes (128K tokens) and the ``wgmma_bwd_supported`` predicate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax import ops
from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops.msa.pallas import BACKWARD_REPORT, FORWARD_REPORT, hopper_backward
from pallas_kernels.common import mosaic_interpreter_available as interpreter_available
from pallas_kernels.msa.gpu_sparse_bwd_wgmma import sparse_bwd_wgmma, wgmma_bwd_supported
from pallas_kernels.msa.gpu_sparse_fwd import sparse_fwd_kv_outer
from tests.kernels.msa.test_msa_kernels_oracle import cosine, make_case, positions, random_ids

needs_interpreter = pytest.mark.skipif(
    not interpreter_available(),
    reason=f"the Mosaic GPU interpreter of jax >= 0.11 is needed (jax {jax.__version__})")

BLK = 128


def _run_and_check(c, ids, chunk, **kw):
    q, k, v = (jnp.asarray(c[n], jnp.bfloat16) for n in ("q", "k", "v"))
    pos = positions(c)
    do = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.bfloat16)
    ids = jnp.asarray(ids)
    args = (pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"], pos["kv_segment_ids"])

    @jax.jit
    def grads(q, k, v, ids, do):
        o, lse = sparse_fwd_kv_outer(q, k, v, ids, *args, block_size=BLK, interpret=True)
        return sparse_bwd_wgmma(q, k, v, ids, *args, o, lse, do, block_size=BLK, chunk=chunk, interpret=True, **kw)
    got = grads(q, k, v, ids, do)
    f32 = lambda x: x.astype(jnp.float32)
    _, vjp = jax.vjp(lambda q, k, v: msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation="xla",
                                                           **pos)[0], f32(q), f32(k), f32(v))
    for name, a, b in zip("qkv", got, vjp(f32(do))):
        assert a.shape == b.shape and a.dtype == jnp.bfloat16, (name, a.shape, a.dtype)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)), name
        scale = np.abs(b).max()
        assert np.max(np.abs(a - b)) <= 5e-2 * scale, (name, np.max(np.abs(a - b)), scale)
        assert cosine(a, b) > 0.99, (name, cosine(a, b))


@needs_interpreter
@pytest.mark.parametrize("h,g", [(16, 2), (32, 2), (8, 2)])
def test_causal_self_attention_gqa(h, g):
    """8 and 16 heads per group, and 4 (in 8-row slots: the training model's GQA); 384 causal tokens, top-3 of 128-key blocks; one program per group's slice
    of 512 sorted selections (whole runs only); f32 dq partials."""
    rng = np.random.default_rng(0)
    c = make_case(rng, bsz=1, t=384, s=384, h=h, g=g, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], g, 3, BLK)
    _run_and_check(c, ids, chunk=512, dq_partial_bits=32)


@needs_interpreter
def test_split_runs_and_bf16_dq_partials():
    """chunk 32: every popular window's run is split over programs (pieces + merge); dq partials in bf16 (the
    default for bf16 inputs)."""
    rng = np.random.default_rng(1)
    c = make_case(rng, bsz=1, t=256, s=256, h=16, g=2, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 2, BLK)
    _run_and_check(c, ids, chunk=32)


@needs_interpreter
def test_packed_documents_and_empty_tokens():
    """Documents of 200, 136 and 48 keys (8-row aligned starts, windows overlapping the next document:
    only owned rows are written), tokens with no selection, duplicate ids; 6 heads per group in 8-row slots."""
    rng = np.random.default_rng(2)
    c = make_case(rng, bsz=1, t=384, s=384, h=12, g=2, d=128, segments=[[200, 136, 48]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 2, BLK)
    ids[0, :, 30:34] = -1
    ids[0, 1, 250, :] = ids[0, 1, 250, 0]
    _run_and_check(c, ids, chunk=64)


@needs_interpreter
def test_queries_as_suffix_of_keys():
    """96 queries after 288 earlier keys (chunked prefill), 16 heads per group."""
    rng = np.random.default_rng(3)
    c = make_case(rng, bsz=1, t=96, s=384, h=32, g=2, d=128)
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 3, BLK)
    _run_and_check(c, ids, chunk=32)


@needs_interpreter
def test_unaligned_windows_take_the_triton_kernel():
    """A document starting at storage 37: its windows are off an 8-row boundary, the pass runs the Triton
    backward (same gradients)."""
    rng = np.random.default_rng(4)
    c = make_case(rng, bsz=1, t=192, s=192, h=16, g=2, d=128, segments=[[37, 155]])
    ids = random_ids(rng, c["q_pos"], c["q_seg"], 2, 2, BLK)
    _run_and_check(c, ids, chunk=32)


def test_lowers_for_cuda_at_m3_shapes():
    """M3 attention shapes at 128K tokens (64 heads, 4 kv groups, D 128, top-16 blocks of 128): the kernel
    (and the Triton one it falls back to on unaligned windows) lower for CUDA on a CPU machine."""
    sd = jax.ShapeDtypeStruct
    b, t, h, g, d, topk = 1, 131072, 64, 4, 128, 16

    def f(q, k, v, ids, pos, o, lse, do):
        return sparse_bwd_wgmma(q, k, v, ids, pos, pos, None, None, o, lse, do, block_size=BLK)
    x = sd((b, t, h, d), jnp.bfloat16)
    kv = sd((b, t, g, d), jnp.bfloat16)
    txt = jax.jit(f).trace(x, kv, kv, sd((b, g, t, topk), jnp.int32), sd((b, t), jnp.int32), x,
                           sd((b, t, h), jnp.float32), x).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("mosaic_gpu") >= 1


def test_supported_shapes():
    assert wgmma_bwd_supported((1, 8, 64, 128), (1, 8, 4, 128), 128, jnp.bfloat16, 128) is None      # M3
    assert wgmma_bwd_supported((1, 8, 48, 128), (1, 8, 8, 128), 128, jnp.float16, 128) is None       # M2
    assert "dtype" in wgmma_bwd_supported((1, 8, 64, 128), (1, 8, 4, 128), 128, jnp.float32, 128)
    assert "heads per group" in wgmma_bwd_supported((1, 8, 130, 128), (1, 8, 2, 128), 128, jnp.bfloat16, 128)
    assert "head dims" in wgmma_bwd_supported((1, 8, 64, 64), (1, 8, 4, 64), 64, jnp.bfloat16, 128)
    assert "block size" in wgmma_bwd_supported((1, 8, 64, 128), (1, 8, 4, 128), 128, jnp.bfloat16, 64)
    assert "heads per group" in wgmma_bwd_supported((1, 8, 64, 128), (1, 8, 0, 128), 128, jnp.bfloat16, 128)


@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("kw,message", [
    (dict(chunk=0), "chunk must be a positive multiple of 32, got 0"),
    (dict(chunk=48), "chunk must be a positive multiple of 32, got 48"),
    (dict(chunk=-32), "chunk must be a positive multiple of 32, got -32"),
    (dict(query_chunk=0), "query_chunk must be a positive int, got 0"),
    (dict(dq_partial_bits=8), "dq_partial_bits must be 16 or 32, got 8"),
    (dict(dq_partial_bits="16"), "dq_partial_bits must be 16 or 32, got '16'"),
    (dict(dtype=jnp.float32), "sparse_.*_wgmma: dtype float32 is not bf16 / f16"),
    (dict(d=64), "sparse_bwd_wgmma: head dims D=64")])
def test_bad_arguments_raise_value_error(kernel, kw, message):
    """Launch arguments and unsupported shapes: a one-line ValueError before anything is traced (any jax, no
    interpreter; also under ``python -O``, which drops asserts)."""
    from pallas_kernels.msa.gpu_sparse_fwd_wgmma import sparse_fwd_wgmma
    kw = dict(kw)
    dtype, d = kw.pop("dtype", jnp.bfloat16), kw.pop("d", 128)
    if kernel == "forward" and ("dq_partial_bits" in kw or d != 128):
        pytest.skip("a backward-only argument")
    sd = jax.ShapeDtypeStruct
    q, kv = sd((1, 256, 16, d), dtype), sd((1, 256, 2, d), dtype)
    ids, pos, lse = sd((1, 2, 256, 2), jnp.int32), sd((1, 256), jnp.int32), sd((1, 256, 16), jnp.float32)
    if kernel == "forward":
        f = lambda q, k, v, ids, pos, o, lse, do: sparse_fwd_wgmma(q, k, v, ids, pos, pos, None, None, block_size=BLK,
                                                                   **kw)
    else:
        f = lambda q, k, v, ids, pos, o, lse, do: sparse_bwd_wgmma(q, k, v, ids, pos, pos, None, None, o, lse, do,
                                                                   block_size=BLK, **kw)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(f, q, kv, kv, ids, pos, q, lse, q)


def _grad_fn(c, ids, blk=BLK):
    pos = positions(c)

    def loss(q, k, v):
        o, _ = msa_ops.msa_attention(q, k, v, ids, block_size=blk, implementation="pallas_hopper_gpu_interpret",
                                     **pos)
        return jnp.sum(o.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))


@needs_interpreter
def test_ops_layer_default_and_report():
    """``pallas_hopper_gpu_interpret`` differentiates through the wgmma backward by default (recorded);
    ``hopper_backward("triton")`` traces the Triton backward (recorded); a shape the wgmma backward refuses
    (D = 64) records the Triton one with the reason."""
    rng = np.random.default_rng(5)
    c = make_case(rng, bsz=1, t=128, s=128, h=16, g=2, d=128)
    ids = jnp.asarray(random_ids(rng, c["q_pos"], c["q_seg"], 2, 1, BLK))
    q, k, v = (jnp.asarray(c[n], jnp.bfloat16) for n in ("q", "k", "v"))
    ops.clear_implementation_report()
    with hopper_backward("triton"):
        jax.eval_shape(_grad_fn(c, ids), q, k, v)
    assert ops.implementation_report()[BACKWARD_REPORT].startswith("triton (chosen with hopper_backward")
    ops.clear_implementation_report()               # the report joins what every trace recorded
    got = jax.jit(_grad_fn(c, ids))(q, k, v)
    assert ops.implementation_report()[BACKWARD_REPORT].startswith("wgmma (default")
    assert ops.implementation_report()[FORWARD_REPORT].startswith("hopper: query tiles")
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.grad(lambda q, k, v: jnp.sum(msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation="xla",
                                                                 **positions(c))[0]), argnums=(0, 1, 2))(
        f32(q), f32(k), f32(v))
    for a, b in zip(got, ref):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 5e-2 * np.abs(b).max() and cosine(a, b) > 0.99
    c64 = make_case(rng, bsz=1, t=128, s=128, h=16, g=2, d=64)
    x64 = [jnp.asarray(c64[n], jnp.bfloat16) for n in ("q", "k", "v")]
    ops.clear_implementation_report()
    jax.eval_shape(_grad_fn(c64, ids), *x64)
    assert ops.implementation_report()[BACKWARD_REPORT].startswith("triton (the wgmma backward refused: head dims")
    with pytest.raises(ValueError, match="triton' or 'wgmma"):
        with hopper_backward("cudnn"):
            pass
