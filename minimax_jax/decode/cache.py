"""Device-side paged caches: layout, creation, quantisation, writes and gathers.

Layout (one entry per decoder layer, in layer order; a list, so each layer's buffers are updated
in place under buffer donation):

```
layer cache = {
  "k": [G, P, page, D], "v": [G, P, page, D]      kv_dtype ("float32" | "bfloat16" | "float8_e4m3fn")
  "k_scale", "v_scale": [G, P, page] float32      only for fp8 K/V: x ~= float(x_q) * scale
  "ki": [P, page, Di]                              only in "msa" layers; index_dtype
  "ki_scale": [P, page] float32                    only for fp8 index keys
}
```
P = ``num_pages`` (page 0 is the null/scratch page, see pages.py), page = tokens per page (== the
MSA block size for MSA models: MSA_SPEC.md section 5). fp8 scales are per token (and per kv head):
``scale = max|x| / 448`` (448 = largest finite e4m3 value), 1 for an all-zero vector.

A sequence's page table ``[pages_per_seq]`` maps logical page ``n`` (tokens ``[n*page, (n+1)*page)``)
to a physical page id; unused entries are 0 (the null page).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp

from minimax_jax.config import ModelConfig
from minimax_jax.ops.paged import dequantize

__all__ = ["CacheSpec", "init_cache", "quantize", "dequantize", "write_layer", "gather_pages",
           "KV_DTYPES", "FP8_MAX", "cache_device_bytes", "available_memory"]

KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Static description of the caches (hashable: used as a jit static argument).

    Attributes:
      page_size: tokens per page (== ``cfg.index_block_size`` when the model has MSA layers).
      num_pages: physical pages including the null page 0.
      pages_per_seq: page-table width (``ceil(max_len / page_size)``).
      kv_dtype / index_dtype: one of ``KV_DTYPES``.
      layer_types: per layer "full" | "msa" | "sliding" (from the config).
    """

    page_size: int
    num_pages: int
    pages_per_seq: int
    kv_dtype: str
    index_dtype: str
    layer_types: tuple

    def __post_init__(self):
        for name in ("kv_dtype", "index_dtype"):
            if getattr(self, name) not in KV_DTYPES:
                raise ValueError(f"{name} must be one of {KV_DTYPES}, got {getattr(self, name)!r}")
        if self.page_size < 1 or self.num_pages < 2 or self.pages_per_seq < 1:
            raise ValueError(f"bad cache sizes: page_size={self.page_size}, num_pages={self.num_pages}, "
                             f"pages_per_seq={self.pages_per_seq}")

    @property
    def max_len(self) -> int:
        return self.page_size * self.pages_per_seq


def init_cache(cfg: ModelConfig, spec: CacheSpec) -> list[dict[str, jax.Array]]:
    """Zero-filled caches for every layer (see the module docstring for shapes)."""
    g, d, p, n = cfg.num_kv_heads, cfg.head_dim, spec.page_size, spec.num_pages
    out = []
    for lt in cfg.layer_types:
        c = {"k": jnp.zeros((g, n, p, d), spec.kv_dtype), "v": jnp.zeros((g, n, p, d), spec.kv_dtype)}
        if spec.kv_dtype == "float8_e4m3fn":
            c["k_scale"] = jnp.ones((g, n, p), jnp.float32)
            c["v_scale"] = jnp.ones((g, n, p), jnp.float32)
        if lt == "msa":
            c["ki"] = jnp.zeros((n, p, cfg.index_head_dim), spec.index_dtype)
            if spec.index_dtype == "float8_e4m3fn":
                c["ki_scale"] = jnp.ones((n, p), jnp.float32)
        out.append(c)
    return out


def cache_device_bytes(abstract_cache, shardings=None) -> int:
    """Bytes one device holds of caches shaped like ``abstract_cache`` (``jax.eval_shape`` of ``init_cache``):
    all of them, or with ``shardings`` (one ``jax.sharding.Sharding`` per array) each array's shard."""
    leaves = jax.tree.leaves(abstract_cache)
    shards = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    total = 0
    for a, sh in zip(leaves, shards):
        shape = a.shape if sh is None else sh.shard_shape(a.shape)
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


def _host_available() -> int | None:
    """Bytes the host can still give this process: Linux's ``MemAvailable`` (else free pages, ``os.sysconf``),
    capped by a cgroup v2 memory limit when one is set (a container is killed at its limit, not the host's)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def available_memory(device) -> tuple[int, str] | None:
    """``(bytes, what)``: the memory ``device`` can still allocate, and a name for it (host memory for a CPU
    device, else the device's free memory from ``memory_stats``); None when the platform does not say."""
    if device.platform == "cpu":
        avail = _host_available()
        return None if avail is None else (avail, "available host memory")
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some platforms do not implement memory_stats
        return None
    if "bytes_limit" not in stats:
        return None
    return max(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), 0), f"free memory of {device.device_kind}"


def quantize(x: jax.Array, dtype: str):
    """Cast ``x [..., D]`` to the cache dtype. Returns ``(x_q, scale [...] f32 or None)``."""
    if dtype != "float8_e4m3fn":
        return x.astype(dtype), None
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (xf / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def _slots(page_table, positions, page_size):
    """Physical (page, offset) ``[B, T]`` of each token; padding tokens (pos < 0) -> the null page."""
    valid = positions >= 0
    pos = jnp.maximum(positions, 0)
    logical = jnp.minimum(pos // page_size, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, logical, axis=1)
    return jnp.where(valid, page, 0), jnp.where(valid, pos % page_size, 0)


def write_layer(c: dict, k, v, ki, page_table, positions, spec: CacheSpec) -> dict:
    """Write new tokens into one layer's caches.

    Args:
      c: one layer cache (module docstring).
      k, v: ``[B, T, G, D]``; ki: ``[B, T, Di]`` or None (non-MSA layers).
      page_table: ``[B, pages_per_seq]`` int32; positions: ``[B, T]`` int32 (-1 = padding, not written).
    Returns: the updated layer cache (functional update; in place under donation).
    """
    page, off = _slots(page_table, positions, spec.page_size)
    c = dict(c)
    for name, x in (("k", k), ("v", v)):
        xq, s = quantize(x, spec.kv_dtype)
        c[name] = c[name].at[:, page, off].set(jnp.moveaxis(xq, 2, 0))
        if s is not None:
            c[name + "_scale"] = c[name + "_scale"].at[:, page, off].set(jnp.moveaxis(s, 2, 0))
    if ki is not None:
        xq, s = quantize(ki, spec.index_dtype)
        c["ki"] = c["ki"].at[page, off].set(xq)
        if s is not None:
            c["ki_scale"] = c["ki_scale"].at[page, off].set(s)
    return c


def gather_pages(c: dict, page_table, dtype):
    """Contiguous logical view of one layer: ``k, v [B, S, G, D]``, ``ki [B, S, Di]`` or None.

    ``S = pages_per_seq * page_size``; token ``j`` of row ``b`` is logical position ``j``. Slots not
    yet written hold stale data: callers mask them by position (key ``j`` visible only if
    ``j <= q_pos``). Values are dequantised to ``dtype``.
    """
    b, n = page_table.shape

    def kv(name):
        x = c[name][:, page_table]                               # [G, B, n, page, D]
        s = c[name + "_scale"][:, page_table] if name + "_scale" in c else None
        x = dequantize(x, s, dtype)
        g, _, _, p, d = x.shape
        return jnp.moveaxis(x, 0, 3).reshape(b, n * p, g, d)

    ki = None
    if "ki" in c:
        x = c["ki"][page_table]                                  # [B, n, page, Di]
        s = c["ki_scale"][page_table] if "ki_scale" in c else None
        ki = dequantize(x, s, dtype)
        ki = ki.reshape(b, -1, ki.shape[-1])
    return kv("k"), kv("v"), ki
