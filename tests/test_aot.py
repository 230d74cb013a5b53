"""``minimax_jax.aot``: GPU targets and compile-only GPUs (the GPU compiler's plan without a GPU).

Where jax's CUDA plugin is installed (``jax[cuda13]``, no GPU needed) a program compiles for two
compile-only H200s and XLA's buffer plan holds each device's shard; without the plugin (the CI machine)
the helper refuses in one line that names the missing plugin.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minimax_jax import aot

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins") is not None and any(
    importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


def test_shipped_target_h200():
    text = aot.gpu_target_text("h200")
    assert 'device_description_str: "NVIDIA H200"' in text
    assert "cuda_compute_capability {\n    major: 9" in text
    assert aot.gpu_target_memory("h200") == 143_771 * 2 ** 20       # nvidia-smi's 143,771 MiB


def test_target_by_path_and_unknown_name(tmp_path):
    f = tmp_path / "mine.txtpb"          # the shipped target on one line, memory in hex with a spaced colon
    text = " ".join(ln for ln in aot.gpu_target_text("h200").splitlines() if not ln.startswith("#"))
    f.write_text(text.replace("device_memory_size: 150754820096", "device_memory_size : 0x4D2"))
    assert aot.gpu_target_memory(str(f)) == 1234
    partial = tmp_path / "partial.txtpb"   # parses, but XLA would crash on it: refused, fields named
    partial.write_text("gpu_device_info { device_memory_size: 1048576 }")
    with pytest.raises(ValueError, match="missing core_count, threads_per_warp, shared_memory_per_block_optin, "
                                         "cuda_compute_capability, device_description_str"):
        aot.gpu_target_text(str(partial))
    binary = tmp_path / "binary.txtpb"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="binary.txtpb: not a text-format GpuTargetConfig"):
        aot.gpu_target_text(str(binary))
    with pytest.raises(ValueError, match="GPU target is empty"):
        aot.gpu_target_text("")
    with pytest.raises(ValueError, match=r"'b300' is neither a file nor one of \['h200'\]"):
        aot.gpu_target_text("b300")
    with pytest.raises(ValueError, match="GPU count must be >= 1"):
        aot.compile_only_gpus("h200", 0)


@pytest.mark.skipif(HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is installed here")
def test_without_cuda_plugin_one_line_error():
    with pytest.raises(ValueError, match=r"needs jax's CUDA plugin \(pip install \"jax\[cuda13\]\"\)") as e:
        aot.compile_only_gpus("h200", 2)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="needs jax's CUDA plugin (jax[cuda13]); no GPU needed")
def test_compiles_for_two_h200s_and_plans_per_device(tmp_path):
    devices = aot.compile_only_gpus("h200", 2)
    assert [d.device_kind for d in devices] == ["NVIDIA H200"] * 2
    mesh = Mesh(np.array(devices), ("x",))
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda a, b: jnp.sum((a @ b).astype(jnp.float32))).lower(x, w).compile()
    m = compiled.memory_analysis()
    assert m.argument_size_in_bytes == (2048 * 1024 + 1024 * 1024) * 2      # one device's shard + w
    assert "all-reduce" in compiled.as_text()                              # the GPU program, with its collective
    bad = tmp_path / "bad.txtpb"
    bad.write_text("gpu_device_info { no_such_field: 1 }\n")
    with pytest.raises(ValueError, match="bad.txtpb"):
        aot.compile_only_gpus(str(bad), 1)
    assert os.path.isdir(aot.TARGETS_DIR)
