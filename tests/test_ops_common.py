"""minimax_jax.ops.common helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from minimax_jax.ops.common import match_vma


def test_match_vma_marks_kernel_outputs_varying_inside_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))

    seen = {}

    def body(x):
        fresh = jnp.zeros_like(x) + 1.0          # built from scratch: invariant-typed
        y = match_vma(fresh, x)
        seen.update(x=getattr(jax.typeof(x), "vma", None), fresh=getattr(jax.typeof(fresh), "vma", None),
                    y=getattr(jax.typeof(y), "vma", None))
        return y * x

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PS("expert"), out_specs=PS("expert")))(jnp.arange(4.0))
    np.testing.assert_array_equal(out, jnp.arange(4.0))
    if seen["x"] is None:
        pytest.skip(f"jax {jax.__version__} does not type shard_map values with vma here")
    assert set(seen["fresh"]) == set() and set(seen["y"]) == set(seen["x"]) == {"expert"}


def test_match_vma_is_identity_outside_shard_map():
    x = jnp.ones(3)
    assert match_vma(x, x) is x
