"""pallas_kernels.common helpers: shard_map varying-axes typing (match_vma, match_cotangent)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from minimax_jax.ops.moe.permute import permute_rows, sort_by_expert, unpermute_combine
from pallas_kernels import common
from pallas_kernels.common import match_cotangent, match_vma, varying_axes, vma_type


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))


def test_match_vma_marks_kernel_outputs_varying_inside_shard_map():
    seen = {}

    def body(x):
        fresh = jnp.zeros(x.shape) + 1.0         # built from scratch: invariant-typed
        y = match_vma(fresh, x)
        z = match_vma(fresh, vma_type(x))        # the static form carried in custom-VJP residuals
        seen.update(x=varying_axes(x), fresh=varying_axes(fresh), y=varying_axes(y), z=varying_axes(z),
                    same=match_vma(x, x) is x)
        return y * x

    out = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=PS("expert"), out_specs=PS("expert")))(jnp.arange(4.0))
    np.testing.assert_array_equal(out, jnp.arange(4.0))
    # no skip: jax >= 0.10 types shard_map values through manual_axis_type.varying
    assert seen == {"x": {"expert"}, "fresh": frozenset(), "y": {"expert"}, "z": {"expert"}, "same": True}


def test_match_cotangent_adds_and_sums_axes():
    seen = {}

    def body(x):
        inv = jnp.ones(x.shape)                                   # invariant primal
        to_inv = match_cotangent(x, inv)                          # varying ct of an invariant primal: psum
        to_var = match_cotangent(inv, x)                          # invariant ct of a varying primal: pcast
        seen.update(to_inv=varying_axes(to_inv), to_var=varying_axes(to_var), none=match_cotangent(None, x))
        return to_inv * to_var

    out = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=PS("expert"), out_specs=PS("expert")))(jnp.arange(4.0))
    np.testing.assert_array_equal(out, jnp.arange(4.0))         # psum over one rank: the values stay
    assert seen == {"to_inv": frozenset(), "to_var": {"expert"}, "none": None}


def test_custom_vjp_cotangents_typed_like_primals():
    """A varying routing index against an invariant primal: the permutation's backward must psum."""
    def body(x, experts, weights):
        order, inv, _ = sort_by_expert(experts, 4)
        return unpermute_combine(permute_rows(x, order, inv), weights, order, inv)

    x = jnp.arange(12.0).reshape(6, 2)
    experts = jnp.array([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2], [1, 1]], jnp.int32)
    weights = jnp.full((6, 2), 0.5)
    fn = jax.shard_map(body, mesh=_mesh(), in_specs=(PS(), PS("expert"), PS("expert")), out_specs=PS("expert"))
    g = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, experts, weights) ** 2)))(x)   # x invariant, output varying
    np.testing.assert_allclose(g, 2 * x, rtol=1e-6)


def test_varying_axes_raises_without_an_api(monkeypatch):
    class Opaque:            # a type with neither manual_axis_type (jax >= 0.10) nor vma (jax 0.6-0.9)
        pass

    monkeypatch.setattr(common.jax, "typeof", lambda x: Opaque())
    with pytest.raises(RuntimeError, match="varying manual axes"):
        varying_axes(jnp.ones(2))
    with pytest.raises(RuntimeError, match="varying manual axes"):
        match_vma(jnp.ones(2), jnp.ones(2))


def test_varying_axes_reads_the_old_vma_attribute(monkeypatch):
    class Old:               # jax 0.6-0.9: ShapedArray.vma
        vma = frozenset({"data"})

    monkeypatch.setattr(common.jax, "typeof", lambda x: Old())
    assert varying_axes(jnp.ones(2)) == {"data"}


def test_match_vma_is_identity_outside_shard_map():
    x = jnp.ones(3)
    assert match_vma(x, x) is x and match_cotangent(x, x) is x and varying_axes(x) == frozenset()
