"""``pallas_kernels.common.triton_cuda_target`` / ``minimax_jax.ops.registry.assume_backend``: Pallas Triton
lowering for CUDA on a machine without a GPU (jax >= 0.11 asks the local GPU; jax 0.10 has no such lookup: a
no-op there)."""

import pytest

from minimax_jax.ops.registry import assume_backend, default_backend
from pallas_kernels.common import triton_cuda_target

try:
    from jax._src.pallas.triton import gpu_info
except ImportError:
    gpu_info = None
needs_lookup = pytest.mark.skipif(gpu_info is None or not hasattr(gpu_info, "get_gpu_info_from_version"),
                                  reason="this jax lowers Triton kernels without asking for a GPU")


def test_assume_backend_sets_the_backend_and_restores_it():
    before = default_backend()
    with assume_backend("gpu"):
        assert default_backend() == "gpu"
    assert default_backend() == before
    with pytest.raises(ValueError, match="expected cpu, gpu or tpu"):
        with assume_backend("cuda"):
            pass


@needs_lookup
def test_no_gpu_lowers_for_sm90_by_default_and_the_lookup_is_restored():
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is visible: jax's own answer stands")
    outer = gpu_info.get_gpu_info      # the test session runs inside triton_cuda_target() (conftest)
    jax_own = getattr(outer, "__wrapped_local__", outer)
    with pytest.raises(ValueError):    # jax >= 0.11 on a CPU: no GPU to ask
        jax_own()
    with triton_cuda_target("A100"):
        assert gpu_info.get_gpu_info() is not None
    assert gpu_info.get_gpu_info is outer
    gpu_info.get_gpu_info = jax_own    # alone (as in a process without the conftest): the named target
    try:
        with triton_cuda_target("A100"):
            assert gpu_info.get_gpu_info().compute_capability == 80
        with triton_cuda_target():
            assert gpu_info.get_gpu_info().compute_capability == 90
        assert gpu_info.get_gpu_info is jax_own
        with pytest.raises(ValueError, match="unknown GPU 'h200'"):
            with triton_cuda_target("h200"):
                pass
    finally:
        gpu_info.get_gpu_info = outer
