"""``minimax_jax.ops.logits.logits_matmul``: float32 logits, backward in the compute dtype.

Oracle: the float64-free float32 einsum of the same operands (Precision.HIGHEST) and its autodiff
gradients. Fresh random inputs; every element compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops.logits import logits_matmul


def _ref(h, w):
    return jnp.einsum("...h,hv->...v", h.astype(jnp.float32), w.astype(jnp.float32), precision="highest")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_grads_match_float32_oracle(dtype):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k1, (2, 5, 64), jnp.float32).astype(dtype)
    w = (0.1 * jax.random.normal(k2, (64, 96), jnp.float32)).astype(dtype)
    g = jax.random.normal(k3, (2, 5, 96), jnp.float32)
    out, pull = jax.vjp(logits_matmul, h, w)
    rout, rpull = jax.vjp(_ref, h, w)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(rout), rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b, x in zip(pull(g), rpull(g), (h, w)):
        assert a.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                                   atol=tol * float(jnp.max(jnp.abs(b))), err_msg=f"seed {seed}")


def _dots(jaxpr):
    """Every dot_general equation of a jaxpr, nested ones (custom_vjp, pjit bodies) included."""
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _dots(inner if hasattr(inner, "eqns") else inner.jaxpr)


def test_bf16_backward_has_no_float32_matmul():
    h = jnp.ones((4, 8, 32), jnp.bfloat16)
    w = jnp.ones((32, 16), jnp.bfloat16)
    f = jax.grad(lambda h, w: jnp.sum(logits_matmul(h, w) ** 2), argnums=(0, 1))
    dots = list(_dots(jax.make_jaxpr(f)(h, w).jaxpr))
    assert len(dots) == 3          # forward, d h, d w
    for e in dots:
        assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e


def test_rejects_mismatched_operands():
    with pytest.raises(ValueError, match="share the dtype"):
        logits_matmul(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.float32))
    with pytest.raises(ValueError, match="hidden size"):
        logits_matmul(jnp.ones((2, 8)), jnp.ones((6, 4)))
