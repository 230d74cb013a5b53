"""The decode engine's attention on a device mesh: tensor parallelism over kv heads (the paged cache sharded
by kv head) and context parallelism for prefill chunks (a chunk's tokens split over the sequence axes).

Inside ``sharding.use_mesh(mesh, rules)``, ``model_step`` runs each layer's cache write and attention in one
``jax.shard_map`` (GSPMD cannot split the Pallas kernels, opaque custom calls):

- heads: the ``act_kv_heads`` rule's mesh axes whose product divides both head counts (``heads_axes``). Each
  device holds its kv heads' share of K/V in the paged cache (``"k"``, ``"v"`` and their fp8 scales,
  ``[G, P, page, ...]``, sharded on G: ``cache_shardings``, how ``DecodeEngine`` places it) and attends
  with its q heads, index heads (one per kv group) and kv heads; the shared MSA index keys (``"ki"``) are
  replicated. Head h uses kv head ``h // (H / G)``, so contiguous shards of H and G pair up.
- tokens ("gather" path, prefill chunks): the ``length`` rule's other axes when they divide the chunk
  (``plan``). The chunk is laid out in zig-zag order (``context_parallel.zigzag``) when 2n divides it, so
  its causal part costs every device the same; the projections and MLPs run on the local tokens (the
  activations are constrained to the sequence axes); inside the shard_map every device all-gathers the
  chunk's new K/V (and index keys) with their positions, writes them into its copy of its cache shard
  (every device of a head group writes the same values, so the copies stay equal) and runs the ordinary
  prefill ops on its local queries against the gathered pages (queries may sit anywhere: MSA_SPEC.md
  sections 3 and 5). Decode steps (Q <= 16 rows) keep every row on every device of a head group.

Batch rows are not split (each cache copy must receive every row's keys): other mesh axes repeat the
attention. The implementation report records ``mesh_attention/gather`` (prefill) and ``mesh_attention/paged``
(decode): ``sequence=n,heads=axes,order=...``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from minimax_jax import sharding
from minimax_jax.config import ModelConfig
from minimax_jax.decode.cache import CacheSpec, write_layer
from minimax_jax.ops import context_parallel
from minimax_jax.ops.registry import record_implementation

__all__ = ["HEAD_SHARDED", "heads_axes", "cache_shardings", "sequence_devices", "prefill_chunk", "describe_cache",
           "plan", "order", "constrain", "write_and_attend"]

#: Cache arrays with a leading kv-head axis (sharded over ``heads_axes``); the others are replicated.
HEAD_SHARDED = ("k", "v", "k_scale", "v_scale")


def heads_axes(cfg: ModelConfig, mesh, rules) -> tuple[str, ...]:
    """Mesh axes (the ``act_kv_heads`` rule's, size > 1) the kv heads split over: the leading run whose
    product divides both ``num_heads`` and ``num_kv_heads`` (() = heads not split)."""
    return context_parallel.dividing_axes(mesh, rules["act_kv_heads"], math.gcd(cfg.num_heads, cfg.num_kv_heads),
                                          set())


def sequence_devices(mesh_text: str | None, rules) -> int:
    """Devices a prefill chunk's tokens split over on the mesh ``mesh_text`` (``MeshSpec`` text, e.g.
    "sequence=4,tensor=2"; None = one device): the product of the ``length`` rule's axis sizes (1 = none).
    Raises ShardingError (a ValueError) for a bad spec or one the visible devices cannot fill."""
    if not mesh_text:
        return 1
    spec = sharding.MeshSpec.parse(mesh_text).resolve(jax.device_count())
    return math.prod(getattr(spec, a) for a in rules["length"])


def prefill_chunk(n: int, chunk: int, explicit: bool) -> int:
    """The prefill chunk for ``n`` sequence devices: an automatic one rounds up to a multiple of 2n (zig-zag
    balance). Raises ValueError (one line) for an ``explicit`` chunk that n does not divide (it would run
    unsplit on every device)."""
    if n <= 1:
        return chunk
    if explicit and chunk % n:
        raise ValueError(f"--prefill_chunk {chunk} does not split over the mesh's sequence axis ({n} devices): "
                         f"pass a multiple of {n} ({2 * n} for balanced causal work)")
    return chunk if explicit else -(-chunk // (2 * n)) * 2 * n


def describe_cache(cfg: ModelConfig, mesh, rules) -> str | None:
    """One line on how the engine's KV cache is laid out over ``mesh`` (None: one device or no head axis)."""
    axes = [a for a in rules["act_kv_heads"] if mesh.shape.get(a, 1) > 1]
    if not axes:
        return None
    heads = heads_axes(cfg, mesh, rules)
    if heads:
        return (f"KV cache: sharded by kv head over {','.join(f'{a}={mesh.shape[a]}' for a in heads)} "
                f"({cfg.num_kv_heads} kv heads)")
    return (f"KV cache: replicated on every device: {','.join(f'{a}={mesh.shape[a]}' for a in axes)} does not "
            f"divide the {cfg.num_kv_heads} kv heads and {cfg.num_heads} heads (attention repeats on each device)")


def cache_shardings(cfg: ModelConfig, cache: list[dict], mesh, rules) -> list[dict]:
    """``NamedSharding`` per cache array: ``HEAD_SHARDED`` arrays split on their kv-head axis over
    ``heads_axes``, the rest replicated over ``mesh``."""
    heads = heads_axes(cfg, mesh, rules) or None
    return [{n: NamedSharding(mesh, PS(heads) if n in HEAD_SHARDED else PS()) for n in c} for c in cache]


def plan(cfg: ModelConfig, batch: int, tokens: int, path: str) -> context_parallel.Plan | None:
    """The mesh plan of a ``[batch, tokens]`` step (``seq``: token axes, only for the "gather" path and when
    they divide ``tokens``; ``heads``: ``heads_axes``), or None: no ``use_mesh`` context, or neither splits."""
    ctx = sharding.current()
    if ctx is None:
        return None
    mesh, rules = ctx
    heads = heads_axes(cfg, mesh, rules)
    seq: tuple[str, ...] = ()
    if path == "gather":
        s = tuple(a for a in rules["length"] if mesh.shape[a] > 1 and a not in heads)
        if s and tokens % sharding.mesh_axis_size(mesh, s) == 0:
            seq = s
    if not seq and not heads:
        return None
    return context_parallel.Plan(mesh, tokens, seq, (), heads)


def order(p: context_parallel.Plan | None) -> np.ndarray | None:
    """Zig-zag token order of the chunk when ``p`` splits tokens over n devices and ``2n`` divides it."""
    if p is None or not p.seq or p.tokens % (2 * p.size):
        return None
    return context_parallel.zigzag(p.tokens, p.size)


def constrain(p: context_parallel.Plan | None, x: jax.Array) -> jax.Array:
    """``x`` ``[B, T, ...]`` sharded over the plan's sequence axes along T (unchanged without them)."""
    if p is None or not p.seq:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(p.mesh, PS(None, p.seq)))


def write_and_attend(p: context_parallel.Plan, attend: Callable, cache: dict, spec: CacheSpec, q, k, v, qi, ki,
                     page_table, positions, path: str):
    """Write the step's keys into one layer's cache and attend, per device (module docstring).

    Args:
      p: from ``plan``. attend: ``attend(cache, q, qi, page_table, positions) -> o`` on local arrays (the
        step's "gather" or "paged" attention). cache: one layer's cache dict. q ``[B, T, Hq, D]``, k / v
        ``[B, T, G, D]``, qi ``[B, T, G, Di]`` / ki ``[B, T, Di]`` or None (non-MSA layers), page_table
        ``[B, n]``, positions ``[B, T]`` (``-1`` = padding), in the step's token order. path: the step's
        path ("gather" | "paged"), recorded as ``mesh_attention/<path>``.
    Returns: ``(o [B, T, Hq, D], updated cache dict)``, sharded like the inputs.
    """
    names = sorted(cache)
    spec_of = p.spec                                            # "b": (), "t": sequence axes, "h": head axes
    cache_specs = [PS(p.heads or None) if n in HEAD_SHARDED else PS() for n in names]
    has_index = qi is not None
    q_side = [(q, "bth."), (positions, "bt")] + ([(qi, "bth.")] if has_index else [])
    kv_side = [(k, "bth."), (v, "bth.")] + ([(ki, "bt.")] if has_index else [])

    def gather(x):
        return jax.lax.all_gather(x, p.seq, axis=1, tiled=True) if p.seq else x

    def body(*args):
        q_l, qpos = args[0], args[1]
        qi_l = args[2] if has_index else None
        rest = args[len(q_side):]
        k_l, v_l = rest[0], rest[1]
        ki_l = rest[2] if has_index else None
        table, arrays = rest[len(kv_side)], rest[len(kv_side) + 1:]
        c = write_layer(dict(zip(names, arrays)), gather(k_l), gather(v_l), None if ki_l is None else gather(ki_l),
                        table, gather(qpos), spec)
        return (attend(c, q_l, qi_l, table, qpos), *(c[n] for n in names))

    kind = ("natural" if order(p) is None else "zigzag") if p.seq else "-"
    record_implementation(f"mesh_attention/{path}",
                          f"sequence={p.size if p.seq else 1},heads={'x'.join(p.heads) or '-'},order={kind}")
    # check_vma=False: the kernels' pallas_calls return invariant-typed values (see pallas_kernels.common);
    # every input is sharded or replicated consistently, so the plain rules are exact.
    fn = jax.shard_map(body, mesh=p.mesh,
                       in_specs=(*(spec_of(lay) for _, lay in (*q_side, *kv_side)), PS(), *cache_specs),
                       out_specs=(spec_of("bth."), *cache_specs), check_vma=False)
    out = fn(*(x for x, _ in q_side), *(x for x, _ in kv_side), page_table, *(cache[n] for n in names))
    return out[0], dict(zip(names, out[1:]))
