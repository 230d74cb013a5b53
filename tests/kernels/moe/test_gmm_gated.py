"""The first MoE grouped matmul fused with its surroundings, in interpret mode on CPU: the gated activation in its
epilogue (``gpu_gmm_gated.gmm_gated``, the gated ``gmm_fp8``), its input rows gathered from the tokens by its loads
(``gmm_forward(lhs_rows=)``), and the MoE op's choice of them (``fused_first.expert_mlp_from_tokens``).

Oracles: the separate path (the same grouped matmul to ``h [M, 2I]`` in the input dtype, then the activation in
XLA), which the fused epilogue reproduces to one ulp of the output dtype (it rounds gate / up to the input dtype
first, as the separate path stores them; the activation's exp may differ by a float32 ulp between the kernel and
XLA); ``ragged_dot`` in float32 followed by the activation in float32 (bf16
tolerance); rows past the group sum are 0. Gradients (the separate path by construction) equal the separate
path's bit for bit. Both activations (SwiGLU, M3's clamped swigluoai with a small clamp so that it bites), tails
(half-height tiles, folding, visit groups, N tails), FP8 weights, the op-level choice and its report, lowering
for CUDA at M2 / M3 shapes. Gathered rows: equal bit for bit to the kernel on the gathered copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import moe
from minimax_jax.ops.moe import Fp8Weight
from minimax_jax.ops.moe.activation import GatedActivation
from minimax_jax.ops.moe.grouped_matmul import sorted_expert_mlp
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from pallas_kernels.moe import gpu_gmm, gpu_gmm_fp8, gpu_gmm_gated
from pallas_kernels.moe.gpu_gmm import TileConfig
from tests.kernels.moe.test_gmm_fp8 import _fp8_case
from tests.kernels.moe.test_gmm_pallas import HI, _close, _sizes

ACTS = (GatedActivation("silu"), GatedActivation("swigluoai", alpha=1.702, limit=1.5))
SMALL = TileConfig(32, 32, 64, 4, 2)


def _case(seed, m, k, i, g, n_empty, dtype):
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, m, g, n_empty)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(g, k, 2 * i)) / np.sqrt(k) * 2.0, dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), int(sizes.sum())


def _separate(lhs, rhs, gs, act, cfg=SMALL):
    return act(gpu_gmm.gmm(lhs, rhs, gs, config=cfg, dlhs_config=cfg, tgmm_config=SMALL, interpret=True))


def _near(got, ref, dtype, what):
    """Fused vs separate: the same h, the activation evaluated in the kernel vs in XLA (whose vectorised exp may
    differ by an ulp of float32): equal up to one ulp of ``dtype`` (bf16: 2**-7 relative; f32: 1e-5); in bf16
    equal bit for bit in all but a few elements."""
    g, r = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(g, r, rtol=2.0**-7 if dtype == jnp.bfloat16 else 1e-5,
                               atol=1e-6 * max(np.abs(r).max(), 1e-30), err_msg=what)
    if dtype == jnp.bfloat16:
        assert np.mean(g != r) < 0.01, f"{what}: {np.mean(g != r):.3f} differ"


def _eq(a, b, what):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=what)


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.kind)
@pytest.mark.parametrize("cfg", [None, TileConfig(32, 32, 16, 4, 2, half_tail=True),
                                 TileConfig(128, 32, 32, 4, 2, fold=64), TileConfig(32, 16, 32, 4, 2, visit_group=4)],
                         ids=lambda c: "default" if c is None else c.label())
@pytest.mark.parametrize("m,k,i,g,n_empty,dtype", [(230, 64, 48, 6, 2, jnp.bfloat16), (200, 40, 32, 5, 1, jnp.float32)])
def test_gated_forward_equals_separate_path_and_oracle(act, cfg, m, k, i, g, n_empty, dtype):
    """Fused output == separate path (one ulp), close to the float32 oracle, 0 past the group sum; the tiles cut
    to a bn dividing I (default 128 -> 16 at I = 48)."""
    lhs, rhs, gs, total = _case(m + k + i, m, k, i, g, n_empty, dtype)
    got = jax.jit(lambda a, b: gpu_gmm_gated.gmm_gated(a, b, gs, act.gate_fn, config=cfg, interpret=True))(lhs, rhs)
    assert got.shape == (m, i) and got.dtype == dtype
    sep_cfg = dataclasses.replace(SMALL, bk=(cfg or gpu_gmm_gated.DEFAULT_GATED_CONFIG).bk)   # one accumulation order
    sep = jax.jit(_separate, static_argnums=(3, 4))(lhs, rhs, gs, act, sep_cfg)
    _near(got, sep, dtype, "fused vs separate")
    assert not np.any(np.asarray(got, np.float32)[total:])
    h = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, precision=HI)
    ref = act.pair(*jnp.split(h.astype(dtype).astype(jnp.float32), 2, axis=-1))   # h rounded as the kernel's
    _close(np.asarray(got, np.float32)[:total], np.asarray(ref)[:total], dtype, "fused vs fp32 oracle",
           rtol=None if dtype == jnp.float32 else 2.0**-7)


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.kind)
def test_gated_gradients_equal_separate_path(act):
    """Differentiated, gmm_gated runs the separate path: value and d lhs / d rhs equal it bit for bit."""
    lhs, rhs, gs, _ = _case(7, 190, 64, 32, 5, 1, jnp.bfloat16)
    cot = jnp.asarray(np.random.default_rng(3).normal(size=(190, 32)), jnp.bfloat16)

    def run(f):
        return jax.jit(lambda a, b: (lambda y, vjp: (y, *vjp(cot)))(*jax.vjp(f, a, b)))(lhs, rhs)
    got = run(lambda a, b: gpu_gmm_gated.gmm_gated(a, b, gs, act.gate_fn, forward_config=SMALL, dlhs_config=SMALL,
                                             tgmm_config=SMALL, interpret=True))
    ref = run(lambda a, b: _separate(a, b, gs, act))
    for a, b, what in zip(got, ref, ("y", "dlhs", "drhs")):
        _eq(a, b, what)


def test_gated_config_and_errors():
    """bn is cut to the largest power of two dividing I; I not a multiple of 16, an odd 2I and a wrong config
    type are refused with a message."""
    gated_config = gpu_gmm_gated.gated_config
    assert gated_config(1536) == gpu_gmm_gated.DEFAULT_GATED_CONFIG and gated_config(1536).bn == 128
    assert gated_config(48).bn == 16 and gated_config(96, TileConfig(64, 32, 64, 4, 2)).bn == 32
    assert "multiple of 16" in gated_config(40)
    lhs, rhs, gs, _ = _case(1, 64, 32, 20, 3, 1, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        gpu_gmm_gated.gmm_gated(lhs, rhs, gs, ACTS[0].gate_fn, interpret=True)
    with pytest.raises(TypeError, match="TileConfig"):
        gpu_gmm_gated.gmm_gated(lhs, rhs[..., :32], gs, ACTS[0].gate_fn, config="128x64", interpret=True)
    with pytest.raises(ValueError, match="kind"):
        GatedActivation("gelu")
    assert GatedActivation("silu").gate_fn == GatedActivation("silu").gate_fn       # a static argument: hashable, equal
    assert hash(GatedActivation("silu").gate_fn) == hash(GatedActivation("silu").gate_fn)


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.kind)
@pytest.mark.parametrize("cfg", [None, gpu_gmm_fp8.DECODE_FP8_CONFIG], ids=("default", "decode"))
def test_gated_fp8_equals_separate(act, cfg):
    """FP8 weights dequantised in the gated kernel == the FP8 kernel then the activation (one ulp), 0 past the
    sum; the lhs gradient (h recomputed) equals the separate path's bit for bit."""
    m, k, i, g = 220, 256, 128, 5
    lhs, q, scale, _, gs, sizes = _fp8_case(11, m, k, 2 * i, g, 1, (128, 128))
    fused = lambda a: gpu_gmm_fp8.gmm_fp8(a, q, scale, gs, config=cfg, interpret=True,  # noqa: E731
                                          gate_fn=act.gate_fn)
    sep = lambda a: act(gpu_gmm_fp8.gmm_fp8(a, q, scale, gs, config=cfg, interpret=True))                 # noqa: E731
    cot = jnp.asarray(np.random.default_rng(2).normal(size=(m, i)), jnp.bfloat16)
    got = jax.jit(lambda a: (lambda y, vjp: (y, *vjp(cot)))(*jax.vjp(fused, a)))(lhs)
    ref = jax.jit(lambda a: (lambda y, vjp: (y, *vjp(cot)))(*jax.vjp(sep, a)))(lhs)
    _near(got[0], ref[0], jnp.bfloat16, "y")
    _eq(got[1], ref[1], "dlhs")
    assert not np.any(np.asarray(got[0], np.float32)[int(sizes.sum()):])
    with pytest.raises(ValueError, match="gated"):
        gpu_gmm_fp8.gmm_fp8(lhs, q[..., :192], scale[..., :2], gs, interpret=True, gate_fn=act.gate_fn)


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.kind)
def test_moe_op_fuses_a_gated_activation_and_reports_it(act):
    """moe_experts(pallas_gpu_interpret) with a GatedActivation: the first matmul gathered the token rows and ran the
    activation in its epilogue (reports), output (one ulp) and gradients (bit for bit) equal the same layer with the
    activation as a plain function (separate path: permute, both matmuls; reported so), a gradient trace reports
    the separate path, too large a token matrix for int32 offsets is refused with the reason, the XLA grouped
    matmul says it has no epilogue, and FP8 experts fuse too."""
    from minimax_jax.ops.moe.fused_first import _gather_problem
    n, h, e, i, k = 80, 64, 4, 32, 2
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.bfloat16)
    w, ex, _ = moe.route(x, jnp.asarray(rng.normal(size=(h, e)), jnp.float32), jnp.zeros((e,)), k)
    wi = jnp.asarray(rng.normal(size=(e, h, 2 * i)) / 8, jnp.bfloat16)
    wo = jnp.asarray(rng.normal(size=(e, i, h)) / 8, jnp.bfloat16)

    def run(a, grad):
        f = lambda x, wi, wo: moe.moe_experts(x, w, ex, wi, wo, a, implementation="pallas_gpu_interpret")  # noqa: E731
        if not grad:
            return jax.jit(f)(x, wi, wo)
        return jax.jit(jax.grad(lambda *p: jnp.sum(f(*p).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(x, wi, wo)

    for grad in (False, True):
        clear_implementation_report()
        got = run(act, grad)
        rep = implementation_report()
        assert rep["grouped_matmul.gated"] == ("separate (differentiated)" if grad else
                                               "fused into the first grouped matmul's epilogue (gathered rows)"), rep
        assert rep["grouped_matmul.gather"] == ("separate (differentiated)" if grad else
                                                "the first grouped matmul gathers the token rows and applies the "
                                                "activation in its epilogue"), rep
        clear_implementation_report()
        ref = run(lambda hh: act(hh), grad)
        for key in ("grouped_matmul.gated", "grouped_matmul.gather"):
            assert implementation_report()[key] == "separate (the activation is not a GatedActivation)"
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            if grad:
                _eq(a, b, "gradient")
            else:
                _near(a, b, jnp.bfloat16, "output")
    big = jax.ShapeDtypeStruct((2**20, 2**11), jnp.bfloat16)
    assert "int32" in _gather_problem("pallas_gpu", big, 2**21, wi, act)
    # XLA grouped matmul: separate, and said so
    clear_implementation_report()
    sorted_expert_mlp(x, jnp.array([30, 34, 0, 0], jnp.int32), wi, wo, act, "xla")
    assert implementation_report()["grouped_matmul.gated"] == "separate (grouped matmul 'xla' has no gated epilogue)"
    # FP8 experts (128 x 128 blocks need I % 128: a wider case)
    lhs, q, scale, _, gs, _ = _fp8_case(4, 96, 128, 256, 3, 1, (128, 128))
    clear_implementation_report()
    got = sorted_expert_mlp(lhs, gs, Fp8Weight(q, scale, (128, 128)), jnp.asarray(rng.normal(size=(3, 128, 128)) / 8,
                            jnp.bfloat16), act, "pallas_gpu_interpret", out_dtype=jnp.bfloat16)
    assert implementation_report()["grouped_matmul.gated"].startswith("fused"), implementation_report()
    assert got.shape == (96, 128) and np.all(np.isfinite(np.asarray(got, np.float32)))


def test_model_activation_is_the_fused_one():
    """The model passes its config's GatedActivation (so MoE layers fuse), with the config's alpha / limit."""
    from minimax_jax.config import ModelConfig
    from minimax_jax.model.layers import gated_activation, swiglu
    cfg = dataclasses.replace(ModelConfig(), mlp_activation="swigluoai", swiglu_alpha=1.5, swiglu_limit=3.0)
    assert gated_activation(cfg) == GatedActivation("swigluoai", 1.5, 3.0)
    x = jnp.linspace(-6, 6, 64, dtype=jnp.float32).reshape(2, 32)
    g, u = jnp.split(x, 2, axis=-1)
    gc = jnp.minimum(g, 3.0)
    np.testing.assert_allclose(swiglu(x, cfg), gc * jax.nn.sigmoid(1.5 * gc) * (jnp.clip(u, -3.0, 3.0) + 1), rtol=1e-6)


def test_gated_kernels_lower_for_cuda_at_m2_m3_shapes():
    """The gated forward lowers to one Triton call for CUDA at M2's (bf16, and FP8 read as byte pairs) and M3's
    first-projection shapes on this CPU machine."""
    sd = jax.ShapeDtypeStruct
    act = ACTS[1]
    for m, kd, i, g in ((65536, 3072, 1536, 256), (32768, 6144, 3072, 128)):
        txt = jax.jit(lambda a, b, gs: gpu_gmm_gated.gmm_gated(a, b, gs, act.gate_fn)).trace(
            sd((m, kd), jnp.bfloat16), sd((g, kd, 2 * i), jnp.bfloat16), sd((g,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") == 1 and "gmm_gpu_gated" in txt
        # the same with the rows gathered from the m / top-k tokens (M2: 8, M3: 4 experts per token)
        txt = jax.jit(lambda a, b, gs, r: gpu_gmm.gmm_forward(a, b, gs, gate_fn=act.gate_fn, lhs_rows=r,
                                                               config=gpu_gmm_gated.gated_config(i))).trace(
            sd((m // (8 if i == 1536 else 4), kd), jnp.bfloat16), sd((g, kd, 2 * i), jnp.bfloat16),
            sd((g,), jnp.int32), sd((m,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("__gpu$xla.gpu.triton") == 1 and "gmm_gpu_gated_gather" in txt
    m, kd, i, g = 65536, 3072, 1536, 256
    txt = jax.jit(lambda a, b, s, gs: gpu_gmm_fp8.gmm_fp8(a, b, s, gs, gate_fn=act.gate_fn)).trace(
        sd((m, kd), jnp.bfloat16), sd((g, kd, 2 * i), jnp.float8_e4m3fn), sd((g, kd // 128, 2 * i // 128), jnp.float32),
        sd((g,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "gmm_fp8_gpu_gated" in txt


@pytest.mark.parametrize("cfg", [SMALL, TileConfig(32, 32, 16, 4, 2, half_tail=True), TileConfig(128, 32, 32, 4, 2, fold=64),
                                 TileConfig(32, 16, 32, 4, 2, visit_group=4)], ids=lambda c: c.label())
def test_gathered_rows_equal_the_sorted_copy(cfg):
    """gmm_forward(lhs_rows=) on the token matrix == gmm_forward on the gathered copy, bit for bit (plain, gated,
    FP8 gated), 0 past the group sum, whatever the rows past the sum point at."""
    rng = np.random.default_rng(9)
    t, kdim, i, g = 70, 64, 64, 5
    x = jnp.asarray(rng.normal(size=(t, kdim)), jnp.bfloat16)
    sizes = _sizes(rng, 240, g, 1)
    total = int(sizes.sum())
    rows = jnp.asarray(np.concatenate([rng.integers(0, t, total), np.full(240 - total, t - 1)]), jnp.int32)
    gs = jnp.asarray(sizes, jnp.int32)
    rhs = jnp.asarray(rng.normal(size=(g, kdim, 2 * i)) / 8, jnp.bfloat16)
    for gate_fn in (None, ACTS[1].gate_fn):
        got = gpu_gmm.gmm_forward(x, rhs, gs, config=cfg, interpret=True, gate_fn=gate_fn, lhs_rows=rows)
        ref = gpu_gmm.gmm_forward(x[rows], rhs, gs, config=cfg, interpret=True, gate_fn=gate_fn)
        _eq(got, ref, f"gate_fn={gate_fn}")
        assert got.shape == (240, i if gate_fn else 2 * i) and not np.any(np.asarray(got, np.float32)[total:])
    q = jnp.asarray(rng.normal(size=(g, kdim, 256)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
    s = jnp.asarray(rng.uniform(0.01, 0.1, (g, 1, 2)), jnp.float32)
    kw = dict(config=TileConfig(32, 32, 64, 4, 2), interpret=True, rhs_scale=s, scale_block=(128, 128),
              gate_fn=ACTS[0].gate_fn)
    _eq(gpu_gmm.gmm_forward(x, q, gs, lhs_rows=rows, **kw), gpu_gmm.gmm_forward(x[rows], q, gs, **kw), "fp8")


def test_fp8_experts_the_kernel_cannot_dequantise_run_the_separate_gather():
    """FP8 experts whose scale blocks are finer than a tile: the MoE op does not gather in the kernel (reported
    with the reason), dequantises them before the kernel, still fuses the activation, and equals xla_ragged."""
    rng = np.random.default_rng(0)
    n, h, e, i, k, block = 16, 64, 4, 32, 2, (128, 8)

    def fp8(shape):
        q = jnp.asarray(rng.normal(size=shape) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
        return Fp8Weight(q, jnp.full((shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1])), 0.05,
                                     jnp.float32), block)
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.bfloat16)
    w, ex, _ = moe.route(x, jnp.asarray(rng.normal(size=(h, e)), jnp.float32), jnp.zeros((e,)), k)
    wi, wo = fp8((e, h, 2 * i)), fp8((e, i, h))
    clear_implementation_report()
    got = moe.moe_experts(x, w, ex, wi, wo, ACTS[0], implementation="pallas_gpu_interpret")
    rep = implementation_report()
    assert rep["grouped_matmul.gather"].startswith("separate (FP8 experts dequantised before the kernel"), rep
    assert rep["grouped_matmul.gated"].startswith("fused"), rep
    ref = moe.moe_experts(x, w, ex, wi, wo, ACTS[0], implementation="xla_ragged")
    _close(np.asarray(got, np.float32), np.asarray(ref, np.float32), jnp.bfloat16, "fp8 fine blocks", rtol=2.0**-7)


def test_shape_defaults():
    """Weights above GROUPED_VISITS_MIN_BYTES get visit_group 4 in the forward / dlhs defaults (plain and
    gated), smaller ones the base configs."""
    m3 = gpu_gmm.shape_configs(6144, 6144, jnp.bfloat16)         # 75 MB per expert
    assert m3["fwd"].visit_group == 4 and m3["dlhs"].visit_group == 4 and m3["tgmm"] == gpu_gmm.DEFAULT_TGMM_CONFIG
    assert gpu_gmm.shape_configs(3072, 3072, jnp.bfloat16) is gpu_gmm.DEFAULT_CONFIGS   # 19 MB (M2)
    assert gpu_gmm_gated.gated_config(3072, weight_bytes=6144 * 6144 * 2).visit_group == 4
    assert gpu_gmm_gated.gated_config(1536, weight_bytes=3072 * 3072 * 2).visit_group == 1
