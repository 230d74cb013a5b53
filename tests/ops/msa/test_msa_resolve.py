"""Which MSA kernel set ``implementation="auto"`` resolves to under ``registry.assume_backend("gpu")``:
the Hopper set (wgmma indexer / forward) where the device and shapes allow, else the Triton set, else
XLA, with the reasons of those passed over; explicit names refuse with their reason (resolved, never run)."""

import jax
import jax.numpy as jnp
import pytest

import minimax_jax.ops  # noqa: F401  (registers every op)
from minimax_jax.ops import registry
from minimax_jax.ops.msa import pallas as msa_pallas
from minimax_jax.ops.registry import ImplementationUnavailable

S = jax.ShapeDtypeStruct
T = 256
POS = jnp.arange(T, dtype=jnp.int32)[None]
KW = dict(q_positions=POS, kv_positions=POS, q_segment_ids=None, kv_segment_ids=None, block_size=64,
          chunk_size=256)


def _select(dtype=jnp.bfloat16, hi=4, di=128, impl="auto", ki_dtype=None):
    qi, ki = S((1, T, hi, di), dtype), S((1, T, di), ki_dtype or dtype)
    return registry.resolve("msa_select_blocks", impl, qi, ki, topk=4, init_blocks=0, local_blocks=1,
                            **KW).name


def _attention(h=64, g=4, dtype=jnp.bfloat16, impl="auto"):
    q, kv = S((1, T, h, 128), dtype), S((1, T, g, 128), dtype)
    return registry.resolve("msa_attention", impl, q, kv, kv, S((1, g, T, 4), jnp.int32), **KW).name


@pytest.mark.parametrize("cc", ["9.0", None])          # an H100 / H200, or no GPU visible (lowering)
def test_hopper_first_on_hopper(monkeypatch, cc):
    monkeypatch.setattr(msa_pallas, "gpu_compute_capability", lambda: cc)
    with registry.assume_backend("gpu"):
        assert _select() == "pallas_hopper_gpu"
        assert _attention() == "pallas_hopper_gpu"               # M3: 16 heads per group
        assert _attention(h=48, g=8) == "pallas_hopper_gpu"      # M2: 6 heads per group, padded slots
        assert _attention(h=16, g=4) == "pallas_gpu"             # 4 of 8 slot rows: Triton is faster
        with pytest.raises(ImplementationUnavailable, match="4 heads per group fill 4 of"):
            _attention(h=16, g=4, impl="pallas_hopper_gpu")
        assert _select(jnp.float32) == "pallas_gpu"              # the wgmma indexer: bf16 / f16 / e4m3
        assert _attention(dtype=jnp.float32) == "pallas_gpu"
        assert _select(hi=3) == "pallas_gpu"                     # index heads must divide 64
        with pytest.raises(ImplementationUnavailable, match="qi and ki dtypes differ"):
            _select(ki_dtype=jnp.float32, impl="pallas_hopper_gpu")
        with pytest.raises(ImplementationUnavailable, match="float8 index inputs need their scales"):
            _select(jnp.float8_e4m3fn, impl="pallas_hopper_gpu")
        with pytest.raises(ImplementationUnavailable, match="do not fit shared memory"):
            _select_big()
        bf = lambda *shape: S(shape, jnp.bfloat16)
        kl = registry.resolve("indexer_kl", "auto", bf(1, T, 64, 128), bf(1, T, 4, 128), bf(1, T, 4, 128),
                              bf(1, T, 128), S((1, 4, T, 4), jnp.int32), **KW)
        assert kl.name == "pallas_gpu"                           # the Hopper set's KL is the Triton one
        with pytest.raises(ImplementationUnavailable, match="pallas_hopper_gpu.*dtype"):
            _attention(dtype=jnp.float32, impl="pallas_hopper_gpu")
    with registry.assume_backend("cpu"):
        assert _select() == "xla" and _attention() == "xla"


def test_other_gpus_pass_over_hopper_with_the_reason(monkeypatch):
    monkeypatch.setattr(msa_pallas, "gpu_compute_capability", lambda: "8.0")
    with registry.assume_backend("gpu"):
        assert _select() == "pallas_gpu" and _attention() == "pallas_gpu"
        with pytest.raises(ImplementationUnavailable, match="compute capability 9.x"):
            _attention(impl="pallas_hopper_gpu")


def _select_big():
    """Di 256 with blocks of 256 in bf16: the key tiles do not fit beside the q rows."""
    pos = jnp.arange(512, dtype=jnp.int32)[None]
    return registry.resolve("msa_select_blocks", "pallas_hopper_gpu", S((1, 512, 4, 256), jnp.bfloat16),
                            S((1, 512, 256), jnp.bfloat16), topk=2, init_blocks=0, local_blocks=1,
                            **dict(KW, q_positions=pos, kv_positions=pos, block_size=256))


def test_interpreted_hopper_set_refuses_a_small_cpu_pool(monkeypatch):
    monkeypatch.setattr(msa_pallas, "mosaic_interpreter_available", lambda: True)
    monkeypatch.setenv("PJRT_NPROC", "2")                   # XLA reads it before NPROC
    with pytest.raises(ImplementationUnavailable, match="set NPROC=4"):
        _select(impl="pallas_hopper_gpu_interpret")
