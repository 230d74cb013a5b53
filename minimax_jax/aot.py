"""Ahead-of-time compilation for GPUs this machine does not have.

XLA's GPU compiler can compile without a GPU when it is told the target (an ``xla`` GpuTargetConfig text
proto: compute capability, SM count, shared memory, memory size, CUDA / cuDNN versions). JAX exposes it as
compile-only devices (``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)``): a mesh of
them lowers and compiles exactly as on the real GPUs (Triton and Mosaic GPU kernels included) and
``compiled.memory_analysis()`` is the real compiler's buffer plan; nothing can run on them. Needs the CUDA
plugin (``pip install "jax[cuda13]"``), not a GPU. Targets: the files in ``configs/gpu_targets/``, by
name.

Used by ``train.py --plan_for`` (``minimax_jax.train.plan``), ``bench/cp_memory.py --gpu-target`` and
``bench/train_step.py --gpu-target``. Trace inside
``minimax_jax.ops.assume_backend("gpu")`` so the ops' ``"auto"`` choices resolve as on the GPU.
"""

from __future__ import annotations

import os
import re

__all__ = ["TARGETS_DIR", "REQUIRED_FIELDS", "gpu_target_text", "gpu_target_memory", "compile_only_gpus"]

TARGETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "gpu_targets")


#: Fields a target must state: XLA's deviceless compiler reads them (without them it crashes, not errs).
REQUIRED_FIELDS = ("core_count", "threads_per_warp", "shared_memory_per_block_optin", "cuda_compute_capability",
                   "device_memory_size", "device_description_str")


def _field(text: str, name: str) -> str | None:
    """The value of text-format field ``name`` (``name: value`` or ``name { ... }``), or None."""
    m = re.search(rf"(?<![\w]){name}\s*(?::\s*(\"[^\"]*\"|0[xX][0-9a-fA-F]+|[-\w.]+)|(\{{))", text)
    if m is None:
        return None
    return m.group(1) if m.group(1) is not None else "{"


def gpu_target_text(target: str) -> str:
    """The GpuTargetConfig text of ``target``: a name in ``configs/gpu_targets/`` (``"h200"``) or a file path.

    Raises: ValueError (one line) when it is neither, is not text, or lacks a field of ``REQUIRED_FIELDS``.
    """
    if not target:
        raise ValueError("GPU target is empty: give a name in configs/gpu_targets (e.g. h200) or a file")
    path = target if os.path.isfile(target) else os.path.join(TARGETS_DIR, f"{target}.txtpb")
    if not os.path.isfile(path):
        names = sorted(f[:-6] for f in os.listdir(TARGETS_DIR) if f.endswith(".txtpb"))
        raise ValueError(f"GPU target {target!r} is neither a file nor one of {names}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"GPU target {path}: not a text-format GpuTargetConfig (not UTF-8 text)") from None
    missing = [n for n in REQUIRED_FIELDS if _field(text, n) is None]
    if missing:
        raise ValueError(f"GPU target {path}: missing {', '.join(missing)} (see configs/gpu_targets/h200.txtpb)")
    return text


def gpu_target_memory(target: str) -> int:
    """The device memory (bytes) ``target`` states (``gpu_device_info.device_memory_size``)."""
    value = _field(gpu_target_text(target), "device_memory_size")
    return int(value, 0)


def compile_only_gpus(target: str, count: int = 1) -> list:
    """``count`` compile-only CUDA devices of one host described by ``target`` (see ``gpu_target_text``).

    Returns: a list of jax devices (``device_kind`` from the target) to build meshes / shardings on; jit
      lowers and compiles for them, nothing runs.
    Raises: ValueError (one line) for a bad target or count, or when this jax cannot make CUDA topologies
      (no CUDA plugin installed).
    """
    if count < 1:
        raise ValueError(f"GPU count must be >= 1, got {count}")
    text = gpu_target_text(target)
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}", target_config=text)
    except NotImplementedError as e:      # jax without the CUDA plugin
        raise ValueError(f"compiling for GPU target {target!r} needs jax's CUDA plugin (pip install "
                         f"\"jax[cuda13]\"): {str(e).splitlines()[0]}") from None
    except RuntimeError as e:             # JaxRuntimeError: the proto did not parse
        raise ValueError(f"GPU target {target!r}: {str(e).splitlines()[0]}") from None
    return list(topo.devices)
