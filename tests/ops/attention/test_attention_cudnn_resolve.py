"""Which implementation ``attention(implementation="auto")`` resolves to for packed rows under
``registry.assume_backend``: the assumed backend decides, not the machine's (resolved, never run)."""

import jax
import jax.numpy as jnp
import pytest

import minimax_jax.ops  # noqa: F401  (registers every op)
from minimax_jax.ops import registry
from minimax_jax.ops.attention import cudnn

S = jax.ShapeDtypeStruct
Q = S((2, 64, 4, 64), jnp.bfloat16)
POS = jnp.tile(jnp.arange(64, dtype=jnp.int32), (2, 1))
SEG = jnp.zeros((2, 64), jnp.int32).at[:, 32:].set(1)            # two documents per row
KW = dict(q_positions=POS, kv_positions=POS, q_segment_ids=SEG, kv_segment_ids=SEG, sliding_window=None,
          chunk_size=512)


def _resolved(dtype=jnp.bfloat16):
    kv = S((2, 64, 2, 64), dtype)
    return registry.resolve("attention", "auto", S(Q.shape, dtype), kv, kv, **KW).name


@pytest.mark.parametrize("cc,want", [("9.0", "cudnn_packed"), ("10.0", "cudnn_packed"), ("8.0", "pallas_flash_gpu")])
def test_assumed_gpu_resolves_packed_rows_by_the_device(monkeypatch, cc, want):
    monkeypatch.setattr(cudnn, "gpu_compute_capability", lambda: cc)      # the GPU the call would see
    with registry.assume_backend("gpu"):
        assert _resolved() == want
        assert _resolved(jnp.float32) == "pallas_flash_gpu"   # cuDNN's packed layout: bf16/fp16 only
    with registry.assume_backend("cpu"):
        assert _resolved() == "xla"
        assert "got 'cpu'" in cudnn.unavailable_reason(Q)


def test_assumed_gpu_without_a_device_passes_over_cudnn_with_the_reason(monkeypatch):
    monkeypatch.setattr(cudnn, "gpu_compute_capability", lambda: None)    # no GPU visible (a CPU machine)
    with registry.assume_backend("gpu"):
        assert _resolved() == "pallas_flash_gpu"
        assert "GPU backend is only assumed" in cudnn.unavailable_reason(Q)
