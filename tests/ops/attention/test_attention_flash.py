"""``attention(implementation="pallas_flash_*")`` (minimax_jax/ops/attention/flash.py) against the XLA path.

Oracle: ``attention(implementation="xla")`` (the project's reference; masks by positions and
segment ids). The JAX Pallas kernels run in interpret mode on CPU: GPU ``mha`` via its
``interpret=True`` and the TPU ``flash_attention`` via ``pltpu.force_tpu_interpret_mode``. Random
inputs: fresh every run where the failure message gives the seed, seeded elsewhere; every element is compared. The
compiled GPU / TPU paths are checked by lowering for cuda / exporting for tpu (no device compile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import load_config
from minimax_jax.model import forward, init_params
from minimax_jax.ops.attention import attention, flash
from minimax_jax.ops.registry import ImplementationUnavailable, clear_implementation_report, implementation_report


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _packed(rng, bsz, t, tail):
    """Segment ids with random boundaries (mid-block) and a ``tail`` of -1; positions restart per doc."""
    seg = np.zeros((bsz, t), np.int32)
    pos = np.zeros((bsz, t), np.int32)
    for b in range(bsz):
        cuts = np.sort(rng.choice(np.arange(1, t - tail), size=3, replace=False))
        seg[b] = np.searchsorted(cuts, np.arange(t), side="right")
        seg[b, t - tail:] = -1
        for i in range(1, t):
            pos[b, i] = pos[b, i - 1] + 1 if seg[b, i] == seg[b, i - 1] else 0
    return jnp.asarray(pos), jnp.asarray(seg)


def _run(impl, q, k, v, pos, seg, do):
    """Output and (dq, dk, dv) for cotangent ``do``, under a fresh jit (traced anew, so the
    implementation report is recorded; one compile instead of one per op)."""
    f = lambda q, k, v: attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                                  kv_segment_ids=seg, implementation=impl)

    def run(q, k, v, do):
        o, pull = jax.vjp(f, q, k, v)
        return o, pull(do)
    return jax.jit(run)(q, k, v, do)


# T = 200: not a multiple of the 128 block; boundaries fall mid-block; a padding tail of -1.
@pytest.mark.parametrize("backend", ["gpu_interpret", "tpu_interpret"])
@pytest.mark.parametrize("h,g,dtype", [(4, 1, jnp.float32), (2, 2, jnp.bfloat16)])
def test_matches_xla_outputs_and_grads(backend, h, g, dtype):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    bsz, t, d = (2 if dtype == jnp.float32 else 1), 200, 32
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype) for s in
                   [(bsz, t, h, d), (bsz, t, g, d), (bsz, t, g, d), (bsz, t, h, d)])
    pos, seg = _packed(rng, bsz, t, tail=int(rng.integers(1, 30)))
    clear_implementation_report()
    o, grads = _run(f"pallas_flash_{backend}", q, k, v, pos, seg, do)
    assert implementation_report()["attention"] == f"pallas_flash_{backend}"
    ro, rgrads = _run("xla", q, k, v, pos, seg, do)
    assert o.dtype == dtype
    atol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=atol,
                               err_msg=f"seed {seed}")
    assert np.all(np.asarray(o)[np.asarray(seg) < 0] == 0), f"seed {seed}"
    cos_min = 0.999 if dtype == jnp.float32 else 0.99
    for name, a, b in zip("qkv", grads, rgrads):
        assert a.dtype == dtype
        assert _cos(a, b) > cos_min, f"d{name} seed {seed}: cosine {_cos(a, b)}"
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=f"d{name} seed {seed}")


@pytest.mark.parametrize("blocks", [None, (32, 64, 64, 32, 4), (64, 128, 128, 64, 8)])
def test_gpu_backward_tiles_match_xla(blocks):
    """Every backward tiling of the GPU kernel (library defaults, and candidates of bench/flash_blocks.py;
    the default ``GPU_BLOCKS`` is covered by the test above) gives the XLA path's outputs and gradients."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    bsz, t, h, g, d = 1, 200, 4, 2, 32
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                   [(bsz, t, h, d), (bsz, t, g, d), (bsz, t, g, d), (bsz, t, h, d)])
    pos, seg = _packed(rng, bsz, t, tail=int(rng.integers(1, 30)))
    f = lambda q, k, v: flash.flash_attention(q, k, v, seg, backend="gpu_interpret", blocks=blocks)

    def fwd_bwd(q, k, v, do):
        o, pull = jax.vjp(f, q, k, v)
        return o, pull(do)
    o, grads = jax.jit(fwd_bwd)(q, k, v, do)
    ro, rgrads = _run("xla", q, k, v, pos, seg, do)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=1e-4, err_msg=f"seed {seed}")
    for name, a, b in zip("qkv", grads, rgrads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, err_msg=f"d{name} seed {seed}")


def test_gpu_backward_tiles_are_validated():
    x = jnp.zeros((1, 128, 2, 32), jnp.float32)
    seg = jnp.ones((1, 128), jnp.int32)
    with pytest.raises(ValueError, match="block_q_dq == block_kv_dkv"):
        flash.flash_attention(x, x, x, seg, backend="gpu_interpret", blocks=(32, 64, 128, 32, 4))


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="compiled kernels need a GPU/TPU")
def test_compiled_kernel_on_device_matches_xla():
    """On a GPU/TPU machine: the compiled kernel (M3 head dim 128, 16:4 GQA, bf16, packed rows with a
    padding tail, T not a multiple of 128) against the xla path, forward and backward, under jit."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    bsz, t, h, g, d = 2, 1000, 16, 4, 128
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
                   [(bsz, t, h, d), (bsz, t, g, d), (bsz, t, g, d), (bsz, t, h, d)])
    pos, seg = _packed(rng, bsz, t, tail=37)
    run = jax.jit(_run, static_argnums=0)
    clear_implementation_report()
    o, grads = run(f"pallas_flash_{jax.default_backend()}", q, k, v, pos, seg, do)
    assert implementation_report()["attention"] == f"pallas_flash_{jax.default_backend()}"
    ro, rgrads = run("xla", q, k, v, pos, seg, do)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=3e-2,
                               err_msg=f"seed {seed}")
    for name, a, b in zip("qkv", grads, rgrads):
        assert _cos(a, b) > 0.99, f"d{name} seed {seed}: cosine {_cos(a, b)}"


def test_unpacked_call_and_jit():
    """No segment ids (default positions) under jit: identical arrays are accepted as tracers."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    pos = jnp.broadcast_to(jnp.arange(64), (1, 64))

    @jax.jit
    def f(q, k, v, pos):
        return [attention(q, k, v, q_positions=pos, kv_positions=pos, implementation=i)
                for i in ("pallas_flash_gpu_interpret", "xla")]
    o, ro = f(q, k, v, pos)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=1e-5)


def test_interpreted_kernels_work_under_remat():
    """The trainer wraps layers in jax.checkpoint; the interpreted TPU kernel must not carry effects."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    pos, seg = _packed(rng, 1, 64, tail=3)

    def loss(impl):
        f = lambda q: attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                                kv_segment_ids=seg, implementation=impl)
        return jax.jit(jax.grad(lambda q: jnp.sum(jax.checkpoint(f)(q) ** 2)))(q)
    np.testing.assert_allclose(np.asarray(loss("pallas_flash_tpu_interpret")), np.asarray(loss("xla")),
                               atol=1e-4)


def test_errors_name_the_reason():
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32) for _ in range(3))
    pos = jnp.arange(16)[None]
    kw = dict(q_positions=pos, kv_positions=pos, implementation="pallas_flash_gpu_interpret")
    with pytest.raises(ImplementationUnavailable, match="sliding window"):
        attention(q, k, v, sliding_window=4, **kw)
    with pytest.raises(ImplementationUnavailable, match="T == S"):
        attention(q[:, :8], k, v, **{**kw, "q_positions": pos[:, 8:]})
    with pytest.raises(ImplementationUnavailable, match="head_dim"):
        attention(q[..., :8], k[..., :8], v[..., :8], **kw)
    with pytest.raises(ImplementationUnavailable, match="head_dim"):
        big = jnp.zeros((1, 16, 2, 192))
        attention(big, big, big, **{**kw, "implementation": "pallas_flash_tpu_interpret"})
    with pytest.raises(ImplementationUnavailable, match="same array"):
        attention(q, k, v, **{**kw, "kv_positions": pos + 1})
    with pytest.raises(ImplementationUnavailable, match="do not increase"):
        bad = pos.at[0, 5].set(2)
        attention(q, k, v, **{**kw, "q_positions": bad, "kv_positions": bad})
    with pytest.raises(ImplementationUnavailable, match="same array"):   # distinct tracers under jit
        jax.jit(lambda a, b: attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=a,
                                       kv_segment_ids=b, implementation=kw["implementation"])
                )(jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 16), jnp.int32))
    for backend in {"gpu", "tpu"} - {jax.default_backend()}:      # a compiled kernel off its platform
        with pytest.raises(ImplementationUnavailable, match=f"needs a {backend.upper()} backend"):
            attention(q, k, v, **{**kw, "implementation": f"pallas_flash_{backend}"})
    with pytest.raises(ImplementationUnavailable, match="unknown implementation 'pallas_flash'"):
        attention(q, k, v, **{**kw, "implementation": "pallas_flash"})       # the old alias is gone


def test_model_forward_and_grad_match_xla():
    """tiny-m3 cut to two full-attention layers (gemma norms, per-head q/k norm, swigluoai, 8:2 GQA,
    dense + MoE MLPs): packed-row loss and parameter gradients equal the xla path."""
    base = load_config("tiny-m3").replace(num_layers=2, layer_types=("full", "full"),
                                          mlp_types=("dense", "moe"), num_mtp_modules=0)
    params = init_params(base, jax.random.key(0))
    rng = np.random.default_rng(3)
    pos, seg = _packed(rng, 2, 48, tail=5)
    tokens = jnp.asarray(rng.integers(0, base.vocab_size, (2, 48)), jnp.int32)

    def loss(p, impl):
        cfg = base.replace(attention_impl=impl)
        logits = forward(p, cfg, tokens, positions=pos, segment_ids=seg).logits
        return jnp.sum(jnp.where(seg[..., None] >= 0, jax.nn.log_softmax(logits), 0.0)) / 1e3

    vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    clear_implementation_report()
    val, grads = vg(params, "pallas_flash_gpu_interpret")
    assert implementation_report()["attention"] == "pallas_flash_gpu_interpret"
    rval, rgrads = vg(params, "xla")
    np.testing.assert_allclose(float(val), float(rval), rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(rgrads)):
        if np.abs(np.asarray(b)).max() > 0:
            assert _cos(a, b) > 0.999, jax.tree_util.keystr(path)


def test_kernels_lower_for_cuda_and_tpu():
    """Forward + backward of the compiled paths lower on this CPU machine (M3-like D=128, 8:2 GQA)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((1, 256, 8, 128), jnp.bfloat16), sd((1, 256, 2, 128), jnp.bfloat16),
            sd((1, 256, 2, 128), jnp.bfloat16), sd((1, 256), jnp.int32))

    def grad(backend):
        def f(q, k, v, seg):
            loss = lambda q, k, v: flash.flash_attention(q, k, v, seg, backend=backend).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return f
    txt = jax.jit(grad("gpu")).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("triton") >= 3, "expected the fwd, preprocess and bwd Triton kernels"
    txt = jax.export.export(jax.jit(grad("tpu")), platforms=["tpu"])(*args).mlir_module()
    assert txt.count("tpu_custom_call") >= 3, "expected the fwd, dkv and dq Mosaic kernels"
