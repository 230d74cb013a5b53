"""``minimax_jax.ops.linear``: plain weights multiply in XLA; FP8-kept weights (``Fp8Weight``) give the same values
through the in-kernel dequantising FP8 kernel (Pallas interpret mode) as through XLA's dequantised copy, and
``"auto"`` picks the kernel only for GPU decode-sized calls outside a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax import sharding
from minimax_jax.ops.linear import KERNEL_MAX_ROWS, linear
from minimax_jax.ops.moe.fp8_weight import FP8_DTYPE, Fp8Weight, scale_shape
from minimax_jax.ops.registry import assume_backend, clear_implementation_report, implementation_report


def _fp8(k, n, block=(32, 32), seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(0, 60, (k, n)), jnp.float32).astype(FP8_DTYPE)
    s = jnp.asarray(rng.uniform(0.5, 2.0, scale_shape((k, n), block)) / 64, jnp.float32)
    return Fp8Weight(w, s, block)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_kernel_equals_the_dequantised_matmul(dtype):
    w = _fp8(96, 64)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 96)), dtype)
    want = np.asarray((x.astype(jnp.float32) @ w.astype(dtype).astype(jnp.float32)))     # fp32 oracle
    clear_implementation_report()
    with jax.default_matmul_precision("float32"):
        got = linear(x, w, implementation="pallas_gpu_interpret")
        ref = linear(x, w, implementation="xla")
    assert got.shape == (2, 3, 64) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())
    assert implementation_report()["linear"] == "pallas_gpu_interpret; xla"


def test_plain_weights_and_bad_shapes():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.full((8, 3), 0.5, jnp.float32)
    out = linear(x, w)
    assert out.dtype == jnp.bfloat16 and np.all(np.asarray(out, np.float32) == 4.0)
    with pytest.raises(ValueError, match=r"linear: x \(4, 8\) and w \(7, 3\) do not fit"):
        linear(x, jnp.ones((7, 3)))


def test_auto_takes_the_kernel_for_gpu_decode_calls_only():
    w = _fp8(128, 128, (128, 128))
    small = jax.ShapeDtypeStruct((8, 1, 128), jnp.bfloat16)
    large = jax.ShapeDtypeStruct((KERNEL_MAX_ROWS + 1, 128), jnp.bfloat16)
    for backend, x, want in (("gpu", small, "pallas_gpu"), ("gpu", large, "xla"), ("cpu", small, "xla")):
        clear_implementation_report()
        with assume_backend(backend):
            jax.eval_shape(lambda x: linear(x, w), x)             # a new function: traced (and recorded) again
        assert implementation_report()["linear"] == want, (backend, x.shape)
    for n, want in ((1, "pallas_gpu"), (2, "xla")):               # a sharded weight stays with GSPMD
        if len(jax.devices()) < n:
            continue
        mesh = sharding.make_mesh(f"data={n}", jax.devices()[:n])
        clear_implementation_report()
        with assume_backend("gpu"), sharding.use_mesh(mesh, sharding.load_rules("default")):
            jax.eval_shape(lambda x: linear(x, w), small)
        assert implementation_report()["linear"] == want, n
