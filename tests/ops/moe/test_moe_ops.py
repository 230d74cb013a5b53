"""MoE op: routing, every expert implementation against a NumPy loop, gradients, no scatter-add,
token dropping, router-bias update and the balance loss."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.model.params import init_params, layer_segments
from minimax_jax.model.router_bias import update_router_biases
from minimax_jax.ops import moe, registry
from minimax_jax.ops.moe.grouped_matmul import grouped_matmul
from minimax_jax.ops.registry import (ImplementationUnavailable, assume_backend, clear_implementation_report,
                                      implementation_report)

N, H, E, I, K = 37, 16, 6, 8, 3


def _act(g):
    a, b = jnp.split(g.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(g.dtype)


def _np_act(g):
    a, b = np.split(g, 2, axis=-1)
    return a / (1 + np.exp(-a)) * b


def _inputs(seed=0, n=N):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (n, H), jnp.float32)
    router = jax.random.normal(ks[1], (H, E), jnp.float32)
    bias = 0.3 * jax.random.normal(ks[4], (E,), jnp.float32)
    wi = 0.3 * jax.random.normal(ks[2], (E, H, 2 * I), jnp.float32)
    wo = 0.3 * jax.random.normal(ks[3], (E, I, H), jnp.float32)
    return x, router, bias, wi, wo


def _np_route(x, router, bias, k):
    s = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(router, np.float64))))
    sel = s + np.asarray(bias, np.float64)[None]
    experts = np.stack([np.argsort(-row, kind="stable")[:k] for row in sel])
    chosen = np.take_along_axis(s, experts, 1)
    return chosen / chosen.sum(1, keepdims=True), experts


def _np_moe(x, weights, experts, wi, wo, capacity=None):
    x, wi, wo, weights = (np.asarray(a, np.float64) for a in (x, wi, wo, weights))
    out = np.zeros_like(x)
    used = np.zeros(wi.shape[0], int)
    for t in range(x.shape[0]):          # token order = first come, first served
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            if capacity is not None:
                if used[e] >= capacity:
                    continue
                used[e] += 1
            out[t] += weights[t, j] * (_np_act(x[t] @ wi[e]) @ wo[e])
    return out


def test_route_matches_numpy_and_bias_only_chooses():
    x, router, bias, _, _ = _inputs()
    w, e, load = moe.route(x, router, bias, K)
    w_np, e_np = _np_route(x, router, bias, K)
    np.testing.assert_array_equal(np.asarray(e), e_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(load), np.bincount(e_np.reshape(-1), minlength=E).astype(np.float32))
    # Weights come from the unbiased scores of the chosen experts.
    s = np.asarray(jax.nn.sigmoid(x @ router))
    chosen = np.take_along_axis(s, e_np, 1)
    np.testing.assert_allclose(np.asarray(w), chosen / chosen.sum(1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla_dense", "xla_ragged", "xla_capacity"])
def test_experts_match_numpy(impl):
    x, router, bias, wi, wo = _inputs(1)
    w, e, _ = moe.route(x, router, bias, K)
    kw = {"capacity_factor": E / K} if impl == "xla_capacity" else {}   # capacity N: nothing dropped
    clear_implementation_report()
    y = jax.jit(lambda *a: moe.moe_experts(*a, _act, implementation=impl, **kw))(x, w, e, wi, wo)
    assert implementation_report()["moe"] == impl
    np.testing.assert_allclose(np.asarray(y), _np_moe(x, w, np.asarray(e), wi, wo), rtol=1e-5, atol=1e-5)


def test_capacity_drops_late_tokens_like_numpy():
    x, router, bias, wi, wo = _inputs(2)
    w, e, load = moe.route(x, router, bias, K)
    cap = moe.capacity_of(N, K, E, 0.5)
    assert cap == int(np.ceil(0.5 * N * K / E))
    assert int(np.max(load)) > cap  # something is really dropped
    y = moe.moe_experts(x, w, e, wi, wo, _act, implementation="xla_capacity", capacity_factor=0.5)
    np.testing.assert_allclose(np.asarray(y), _np_moe(x, w, np.asarray(e), wi, wo, capacity=cap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,kw", [("xla_ragged", {}), ("xla_capacity", {"capacity_factor": E / K}),
                                     ("xla_capacity", {"capacity_factor": 0.7})])
def test_gradients_match_dense_autodiff(impl, kw):
    """Custom-VJP permutations give the gradients of plain autodiff (dense or a masked dense reference)."""
    x, router, bias, wi, wo = _inputs(3)
    cot = jax.random.normal(jax.random.key(9), (N, H))

    def loss(x, router, wi, wo, impl, kw):
        w, e, _ = moe.route(x, router, bias, K)
        if impl == "masked_dense":  # drop exactly what "xla_capacity" drops, with plain autodiff
            keep = _keep_mask(e, moe.capacity_of(N, K, E, kw["capacity_factor"]))
            w = w * keep
            impl, kw = "xla_dense", {}
        return jnp.sum(moe.moe_experts(x, w, e, wi, wo, _act, implementation=impl, **kw) * cot)

    ref_impl = "masked_dense" if kw.get("capacity_factor", 9) < E / K else "xla_dense"
    g_ref = jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, wi, wo, ref_impl, kw)
    g = jax.jit(jax.grad(lambda *a: loss(*a, impl, kw), argnums=(0, 1, 2, 3)))(x, router, wi, wo)
    for a, b in zip(g_ref, g):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=2e-5)


def _keep_mask(experts, cap):
    flat = np.asarray(experts).reshape(-1)
    seen = np.zeros(E, int)
    keep = np.zeros(flat.shape, np.float32)
    for i, e in enumerate(flat):
        if seen[e] < cap:
            keep[i] = 1
        seen[e] += 1
    return jnp.asarray(keep.reshape(experts.shape))


def test_backward_has_no_scatter_add():
    x, router, bias, wi, wo = _inputs(4)

    def loss(x, wi, wo):
        w, e, _ = moe.route(x, router, bias, K)
        return jnp.sum(moe.moe_experts(x, w, e, wi, wo, _act, implementation="xla_ragged"))

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, wi, wo))
    # The only scatter-add left is the forward's integer expert-load count.
    assert re.findall(r"(\w+)\[[^\]]*\] = scatter-add", text) == ["i32"], re.findall(r".{20}scatter-add", text)
    assert "ragged_dot" in text


def test_auto_resolution_and_errors_on_cpu():
    x, router, bias, wi, wo = _inputs(5)
    w, e, _ = moe.route(x, router, bias, K)
    clear_implementation_report()
    moe.moe_experts(x, w, e, wi, wo, _act, implementation="auto")
    assert implementation_report()["moe"] == "xla_dense"  # N * E small on CPU
    n_big = 65536 // E + 1                             # N * E > 65536: the grouped path (shapes only)
    big = [jax.ShapeDtypeStruct((n_big, H), jnp.float32), jax.ShapeDtypeStruct((n_big, K), jnp.float32),
           jax.ShapeDtypeStruct((n_big, K), jnp.int32)]
    jax.eval_shape(lambda x, w, e: moe.moe_experts(x, w, e, wi, wo, _act, implementation="auto"), *big)
    assert implementation_report()["moe"] == "xla_dense; xla_ragged"  # both calls; XLA ragged_dot off GPU
    with pytest.raises(ImplementationUnavailable, match="tokamax"):
        moe.moe_experts(x, w, e, wi, wo, _act, implementation="tokamax")
    with pytest.raises(ImplementationUnavailable, match="unknown implementation 'megablox'"):
        moe.moe_experts(x, w, e, wi, wo, _act, implementation="megablox")
    with pytest.raises(ValueError, match="capacity_factor"):
        moe.moe_experts(x, w, e, wi, wo, _act, implementation="xla_capacity")
    with pytest.raises(ImplementationUnavailable, match="transport 'pigeon' is not one of"):
        moe.moe_experts(x, w, e, wi, wo, _act, ep_transport="pigeon")
    with pytest.raises(ImplementationUnavailable):
        grouped_matmul(x, wi, jnp.array([N, 0, 0, 0, 0, 0]), implementation="tokamax")


def test_auto_picks_pallas_gpu_on_gpu():
    """On a GPU backend "auto" resolves to the Pallas grouped matmul and records that name (the
    backend is assumed and only shapes are traced: the Triton kernels are not compiled here)."""
    x, router, bias, wi, wo = _inputs(5)
    w, e, _ = moe.route(x, router, bias, K)
    n_big = 65536 // E + 1
    big = [jax.ShapeDtypeStruct((n_big, H), jnp.float32), jax.ShapeDtypeStruct((n_big, K), jnp.float32),
           jax.ShapeDtypeStruct((n_big, K), jnp.int32)]
    with assume_backend("gpu"):
        assert registry.resolve("grouped_matmul", "auto").name == "pallas_gpu"
        clear_implementation_report()
        jax.eval_shape(lambda x, w, e: moe.moe_experts(x, w, e, wi, wo, _act, implementation="auto"), x, w, e)
        assert implementation_report()["moe"] == "xla_dense"   # small problems stay dense on GPU too
        clear_implementation_report()
        out = jax.eval_shape(lambda x, w, e: moe.moe_experts(x, w, e, wi, wo, _act, implementation="auto"), *big)
    assert out.shape == (n_big, H)
    assert implementation_report()["moe"] == "pallas_gpu"
    assert implementation_report()["grouped_matmul"] == "pallas_gpu"


def test_auto_sends_large_experts_to_the_grouped_path():
    """A decode step's few tokens with experts past ``DENSE_MAX_EXPERT_BYTES`` (M2's: 7.2 GB a layer) take the
    grouped path: "xla_dense" would read (and on a GPU widen to float32) every expert in every step."""
    n = 4                                               # N * E far below the token bound
    e, h, i = 16, 1024, 1024                            # 16 * 1024 * 3072 * 4 bytes = 192 MiB of float32 experts
    assert e * h * 3 * i * 4 > moe.DENSE_MAX_EXPERT_BYTES >= 3 * E * H * I * 4     # the other tests: dense
    args = [jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((n, K), jnp.float32),
            jax.ShapeDtypeStruct((n, K), jnp.int32), jax.ShapeDtypeStruct((e, h, 2 * i), jnp.float32),
            jax.ShapeDtypeStruct((e, i, h), jnp.float32)]
    for backend, want in (("cpu", "xla_ragged"), ("gpu", "pallas_gpu")):
        clear_implementation_report()
        with assume_backend(backend):
            jax.eval_shape(lambda x, w, ex, wi, wo: moe.moe_experts(x, w, ex, wi, wo, _act, implementation="auto"),
                           *args)
        assert implementation_report()["moe"] == want, backend


def test_router_bias_update_exact():
    bias = jnp.array([0.0, 0.5, -0.25, 1.0], jnp.float32)
    load = jnp.array([10.0, 2.0, 4.0, 4.0])           # mean 5
    new = moe.update_router_bias(bias, load, 0.125)
    np.testing.assert_array_equal(np.asarray(new), np.array([-0.125, 0.625, -0.125, 1.125], np.float32))


def test_update_router_biases_on_model_params():
    cfg = ModelConfig.from_yaml("configs/tiny-m3.yaml")
    params = init_params(cfg, jax.random.key(0))
    load = jnp.arange(cfg.num_moe_layers * cfg.num_experts, dtype=jnp.float32).reshape(cfg.num_moe_layers, -1) % 5
    new = update_router_biases(params, cfg, load, 0.01)
    row = 0
    for seg, old_s, new_s in zip(layer_segments(cfg), params["segments"], new["segments"]):
        if seg.mlp_type != "moe":
            assert new_s is old_s
            continue
        l = np.asarray(load[row:row + seg.length])
        want = np.asarray(old_s["mlp"]["router_bias"]) + 0.01 * np.sign(l.mean(-1, keepdims=True) - l)
        np.testing.assert_allclose(np.asarray(new_s["mlp"]["router_bias"]), want, rtol=0, atol=1e-7)
        assert new_s["mlp"]["wi"] is old_s["mlp"]["wi"]
        row += seg.length
    assert row == cfg.num_moe_layers
    with pytest.raises(ValueError, match="MoE layers"):
        update_router_biases(params, cfg, load[:1], 0.01)


def test_load_balancing_loss():
    n = 8
    scores = jnp.full((n, 4), 0.5)
    experts = jnp.array([[i % 4, (i + 1) % 4] for i in range(n)], jnp.int32)
    assert float(moe.load_balancing_loss(scores, experts)) == pytest.approx(1.0, abs=1e-7)
    x, router, bias, _, _ = _inputs(6)
    s = moe.router_scores(x, router)
    _, e, _ = moe.route(x, router, bias, K)
    f = np.bincount(np.asarray(e).reshape(-1), minlength=E) / (N * K)
    p = np.mean(np.asarray(s) / np.asarray(s).sum(1, keepdims=True), 0)
    assert float(moe.load_balancing_loss(s, e)) == pytest.approx(E * float(np.sum(f * p)), rel=1e-6)
    g = jax.grad(lambda r: moe.load_balancing_loss(moe.router_scores(x, r), e))(router)
    assert np.all(np.isfinite(np.asarray(g))) and float(jnp.abs(g).sum()) > 0


def test_implementation_names_and_backends():
    """The names config.py checks ``moe_impl`` against come from the registry, in one naming scheme."""
    assert moe.MOE_IMPLEMENTATIONS == ("auto", "xla_dense", "xla_ragged", "xla_capacity", "tokamax", "pallas_gpu",
                                       "pallas_gpu_interpret")
    assert moe.MOE_IMPLEMENTATIONS == registry.implementation_names("moe")
    assert {i.name: i.platforms for i in registry.get_op("moe").implementations.values() if i.platforms} == {
        "tokamax": ("gpu", "tpu"), "pallas_gpu": ("gpu",)}
    assert registry.implementation_names("grouped_matmul") == ("auto", "xla", "tokamax", "pallas_gpu",
                                                               "pallas_gpu_interpret")


@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "weights": a["weights"][:15], "experts": a["experts"][:15]}, "N the rows of x"),
    (lambda a: {**a, "weights": jnp.ones((16, 3))}, "N the rows of x"),
    (lambda a: {**a, "x": jnp.ones((16, 33))}, "H the width of x"),
    (lambda a: {**a, "wi": jnp.ones((8, 32, 129))}, "even gate/up width"),
    (lambda a: {**a, "wo": jnp.ones((8, 72, 32))}, r"wo must be \[E, I, H\] = \[8, 64, 32\]"),
    (lambda a: {**a, "wo": jnp.ones((8, 64, 36))}, r"wo must be \[E, I, H\]"),
    (lambda a: {**a, "experts": a["experts"].astype(jnp.float32)}, "integer expert ids"),
    (lambda a: {**a, "x": a["x"][None]}, r"expects x \[N, H\]"),
])
def test_shape_errors_name_the_operand(change, match):
    """Operands that do not fit raise one ValueError naming the problem and every shape, for every implementation
    (before, a token-count mismatch returned NaN rows from xla_ragged)."""
    ok = dict(x=jnp.ones((16, 32)), weights=jnp.ones((16, 2)), experts=jnp.zeros((16, 2), jnp.int32),
              wi=jnp.ones((8, 32, 128)), wo=jnp.ones((8, 64, 32)))
    assert moe.moe_experts(**ok, act=moe.GatedActivation(), implementation="xla_ragged").shape == (16, 32)
    for impl in ("xla_ragged", "xla_dense", "pallas_gpu_interpret"):
        with pytest.raises(ValueError, match=match):
            moe.moe_experts(**change(ok), act=moe.GatedActivation(), implementation=impl)


def test_expert_ids_out_of_range_contribute_nothing():
    """An expert id outside [0, E) adds nothing to its token and leaves every other token unchanged, in every
    implementation (before, the grouped paths let it shift a neighbour's rows)."""
    x, router, bias, wi, wo = _inputs(5)
    weights, experts = moe.route(x, router, bias, K)[:2]
    bad = experts.at[3, 1].set(E).at[10, 0].set(-1).at[20, 2].set(E + 7)
    keep = weights.at[3, 1].set(0.0).at[10, 0].set(0.0).at[20, 2].set(0.0)
    want = np.asarray(moe.moe_experts(x, keep, experts, wi, wo, _act, implementation="xla_dense"))
    for impl in ("xla_dense", "xla_ragged", "xla_capacity", "pallas_gpu_interpret"):
        kw = {"capacity_factor": float(E)} if impl == "xla_capacity" else {}
        got = np.asarray(moe.moe_experts(x, weights, bad, wi, wo, _act, implementation=impl, **kw))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=impl)
        nan_w = weights.at[3, 1].set(jnp.nan).at[10, 0].set(jnp.inf)       # non-finite weights on bad ids
        got = np.asarray(moe.moe_experts(x, nan_w, bad, wi, wo, _act, implementation=impl, **kw))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{impl}, non-finite weights")
        for dt in (jnp.int8, jnp.uint8, jnp.int16):                      # narrow id types: same result
            got = np.asarray(moe.moe_experts(x, keep, experts.astype(dt), wi, wo, _act, implementation=impl, **kw))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{impl}, {dt.__name__} ids")


def test_route_errors_name_the_problem():
    """route refuses operands that do not fit and top_k outside [1, E] with one ValueError each."""
    x, router, bias = jnp.ones((4, 8)), jnp.ones((8, 6)), jnp.zeros((6,))
    assert moe.route(x, router, bias, 6)[1].shape == (4, 6)
    for args, match in (((x, router, bias, 7), r"top_k must be in \[1, E = 6\], got 7"),
                        ((x, router, bias, 0), "top_k"),
                        ((x, router, jnp.zeros((5,)), 2), r"bias \(5,\)"),
                        ((jnp.ones((4, 9)), router, bias, 2), r"x \(4, 9\)"),
                        ((x[None], router, bias, 2), r"expects x \[N, H\]")):
        with pytest.raises(ValueError, match=match):
            moe.route(*args)
