"""Expert parallelism (EP) for the dropless MoE, in ``shard_map``.

Layout (mesh axes come from the rule table, never hard-coded here):
- tokens ``[N, H]`` are split over the mesh axes of the ``batch`` and ``length`` rules (minus the
  expert-tensor axes) and always over the expert axes, so every expert-parallel rank holds
  different tokens;
- routed experts are split over the axes of the ``experts`` rule (``P`` ranks, ``E / P`` each;
  ``E`` is padded with never-chosen zero experts when ``P`` does not divide it);
- the expert width ``I`` is split over the axes of the ``mlp_expert`` rule (tensor parallelism
  inside each expert; partial outputs are summed with ``psum``). The fused gate/up columns are
  split as ``[E, H, 2, I]`` so each rank holds matching gate and up slices.

Per rank: sort local assignments by expert (gathers, ``permute``), send each destination rank
the rows of its experts, regroup received rows by local expert, grouped matmul, and send results
back the same way. Transports:
- ``"all_to_all"``: fixed-size ``[P, n*k, H]`` buffers through ``jax.lax.all_to_all``; runs on
  every backend (CPU tests), memory ``P * n * k * H`` per rank.
- ``"ragged_all_to_all"``: ``jax.lax.ragged_all_to_all`` moves only the live rows (GPU/TPU; it
  does not run on CPU); its backward is JAX's transpose rule (the reverse ragged exchange).
- ``"auto"``: all_to_all on GPU and CPU (on GPU the padded exchange measured far faster than XLA's
  ragged_all_to_all, see BENCHMARKS.md (MoE)), ragged_all_to_all on TPU; with ``P == 1`` no exchange at all.
Both are dropless: the receive buffer holds the worst case (``P * n * k`` rows).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as PS

from minimax_jax.ops import registry
from minimax_jax.ops.moe.fp8_weight import Fp8Weight
from minimax_jax.ops.moe.grouped_matmul import OP as GMM_OP
from minimax_jax.ops.moe.grouped_matmul import sorted_expert_mlp
from minimax_jax.ops.moe.permute import gather_rows, group_starts, permute_rows, sort_by_expert, unpermute_combine
from minimax_jax.ops.registry import (ImplementationUnavailable, default_backend, record_implementation,
                                      refine_implementation)
from pallas_kernels.common import match_vma, searchsorted

__all__ = ["moe_expert_parallel", "TRANSPORTS"]

TRANSPORTS = ("auto", "all_to_all", "ragged_all_to_all")


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _axes_arg(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def _plan_axes(mesh, rules, num_experts: int, width: int):
    ep = tuple(rules["experts"])  # size-1 axes kept: a forced exchange over one rank still has an axis
    tp = tuple(a for a in rules["mlp_expert"] if a not in ep and mesh.shape[a] > 1)
    if tp and width % _size(mesh, tp):
        tp = ()  # expert width not divisible: every rank computes the whole width (no psum)
    tok = []
    for a in rules["batch"] + rules["length"]:
        if a not in tok and a not in tp and (mesh.shape[a] > 1 or a in ep):
            tok.append(a)
    # Tokens are always split over the expert-parallel axes (each rank sends its own tokens), also
    # when the batch rule does not name them; GSPMD reshards at the shard_map boundary then.
    tok += [a for a in ep if a not in tok]
    return ep, tp, tuple(tok)


def moe_expert_parallel(x: jax.Array, weights: jax.Array, experts: jax.Array, wi: jax.Array, wo: jax.Array,
                        act: Callable, *, mesh, rules, gmm_impl: str = "auto", transport: str = "auto") -> jax.Array:
    """Dropless MoE expert computation, expert- and tensor-parallel over ``mesh``.

    Args: as ``minimax_jax.ops.moe.moe_experts`` (x ``[N, H]``, weights ``[N, k]`` f32, experts
      ``[N, k]`` int32, wi ``[E, H, 2I]``, wo ``[E, I, H]``); mesh / rules: the active
      ``minimax_jax.sharding`` context; gmm_impl: an implementation of op ``"grouped_matmul"``
      (``grouped_matmul.py``; ``"auto"``: ``"pallas_gpu"`` on GPU, ``"xla"`` elsewhere); transport: one
      of ``TRANSPORTS``.
    Returns: ``[N, H]`` in ``x.dtype``.
    Raises: ImplementationUnavailable for ``"ragged_all_to_all"`` on CPU or an unavailable grouped matmul
      (``moe_experts`` refuses an unknown transport).
    """
    assert transport in TRANSPORTS, transport
    n, h = x.shape
    k = experts.shape[1]
    e, inter = wo.shape[0], wo.shape[1]
    ep, tp, tok = _plan_axes(mesh, rules, e, inter)
    p = _size(mesh, ep)
    # FP8 experts (``Fp8Weight``) enter the shard_map in FP8 when their scale blocks split with the expert
    # width; otherwise dequantised (GSPMD-partitioned, inside the jitted step), recorded either way
    why = _fp8_split_problem(wi, wo, _size(mesh, tp))
    if why is not None:
        record_implementation(GMM_OP + ".fp8_expert_parallel", f"dequantised before the shard_map ({why})")
        wi, wo = (w.astype(x.dtype) if isinstance(w, Fp8Weight) else w for w in (wi, wo))
    elif isinstance(wi, Fp8Weight):
        record_implementation(GMM_OP + ".fp8_expert_parallel", "FP8 experts sharded as stored")
    if transport == "auto":
        # GPU: the padded all_to_all (far faster than XLA's ragged_all_to_all, BENCHMARKS.md (MoE));
        # TPU: ragged_all_to_all (not measured here)
        transport = "none" if p == 1 else ("ragged_all_to_all" if default_backend() == "tpu" else "all_to_all")
    if transport == "ragged_all_to_all" and default_backend() == "cpu":
        raise ImplementationUnavailable("jax.lax.ragged_all_to_all does not run on CPU; use transport='all_to_all'")
    gmm = registry.resolve(GMM_OP, gmm_impl).name
    refine_implementation("moe", f"expert_parallel[{transport},{gmm},ep={p},tp={_size(mesh, tp)}]")

    e_pad = -(-e // p) * p
    if e_pad != e:
        wi, wo = (_pad_experts(w, e_pad - e) for w in (wi, wo))
    shards = _size(mesh, tok)
    n_pad = -(-n // shards) * shards
    if n_pad != n:
        x = jnp.pad(x, ((0, n_pad - n), (0, 0)))
        weights = jnp.pad(weights, ((0, n_pad - n), (0, 0)))
        experts = jnp.pad(experts, ((0, n_pad - n), (0, 0)))
    wi4 = _split_gate_up(wi)

    tok_spec = PS(_axes_arg(tok) if tok else None, None)
    ep_arg = _axes_arg(ep) if ep else None
    tp_arg = _axes_arg(tp) if tp else None
    wi_spec, wo_spec = PS(ep_arg, None, None, tp_arg), PS(ep_arg, tp_arg, None)
    if isinstance(wi4, Fp8Weight):                 # the scales split like the weights (block-aligned, checked)
        wi_spec, wo_spec = (Fp8Weight(sp, sp, w.block) for sp, w in ((wi_spec, wi4), (wo_spec, wo)))
    body = functools.partial(_local, act=act, gmm=gmm, transport=transport, ep=ep, tp=tp, p=p, e_pad=e_pad, k=k)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, wi_spec, wo_spec),
                       out_specs=tok_spec)
    y = fn(x, weights, experts, wi4, wo)
    return y[:n]


def _fp8_split_problem(wi, wo, t: int) -> str | None:
    """None when FP8 experts can be sharded as stored over ``t`` tensor ranks of the expert width (their
    scale blocks split with the gate / up halves and the width shards), else why not; None for bf16."""
    if not any(isinstance(w, Fp8Weight) for w in (wi, wo)):
        return None
    if not all(isinstance(w, Fp8Weight) for w in (wi, wo)):
        return "only one of wi / wo is FP8"
    inter = wo.shape[1]
    if (inter // t) % wi.block[1] or (inter // t) % wo.block[0]:
        return f"expert width {inter} over {t} rank(s) does not split into whole {wi.block} / {wo.block} blocks"
    return None


def _pad_experts(w, extra: int):
    """``w [E, ., .]`` (array or ``Fp8Weight``) with ``extra`` zero experts appended."""
    pad = ((0, extra), (0, 0), (0, 0))
    if isinstance(w, Fp8Weight):
        return Fp8Weight(jnp.pad(w.w, pad), jnp.pad(w.scale_inv, pad), w.block)
    return jnp.pad(w, pad)


def _split_gate_up(wi):
    """``wi [E, H, 2I] -> [E, H, 2, I]`` (an ``Fp8Weight``'s scales ``[E, H/br, 2, I/bc]``, block-aligned)."""
    if isinstance(wi, Fp8Weight):
        return Fp8Weight(wi.w.reshape(wi.shape[:2] + (2, -1)),
                         wi.scale_inv.reshape(wi.scale_inv.shape[:2] + (2, -1)), wi.block)
    return wi.reshape(wi.shape[:2] + (2, -1))


def _local(x, weights, experts, wi4, wo, *, act, gmm, transport, ep, tp, p, e_pad, k):
    """Per-rank body: local tokens ``[n, H]``, local experts ``wi4 [E/P, H, 2, I/T]``, ``wo [E/P, I/T, H]``
    (arrays or ``Fp8Weight``)."""
    e_loc, h = wi4.shape[0], wi4.shape[1]
    if isinstance(wi4, Fp8Weight):
        wi = Fp8Weight(wi4.w.reshape(e_loc, h, -1), wi4.scale_inv.reshape(wi4.scale_inv.shape[:2] + (-1,)),
                       wi4.block)
    else:
        wi = wi4.reshape(e_loc, h, -1)
    order, inv, counts = sort_by_expert(experts, e_pad)
    xs = permute_rows(x, order, inv)                              # [M, H], M = n * k
    if transport == "none":
        ys = sorted_mlp_psum(xs, counts, wi, wo, act, gmm, tp)
    elif transport == "all_to_all":
        ys = _exchange_all_to_all(xs, experts, order, counts, wi, wo, act, gmm, ep, tp, p)
    else:
        ys = _exchange_ragged(xs, counts, wi, wo, act, gmm, ep, tp, p)
    # ys must vary like the local tokens: a kernel output typed invariant (tokamax's; the ragged receive
    # buffer) would give the custom VJP of unpermute_combine a varying cotangent for an invariant primal
    ys = match_vma(ys.astype(x.dtype), x)
    return unpermute_combine(ys, weights, order, inv).astype(x.dtype)


def sorted_mlp_psum(rows, group_sizes, wi, wo, act, gmm, tp):
    """Grouped expert MLP (``grouped_matmul.sorted_expert_mlp``) summed over the tensor axes."""
    y = sorted_expert_mlp(rows, group_sizes, wi, wo, act, gmm)
    if tp:
        y = jax.lax.psum(y, _axes_arg(tp))
    return y.astype(rows.dtype)


def _regroup(key: jax.Array):
    """Full permutation sorting rows by ``key`` (stable) and its inverse."""
    r = key.shape[0]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inv = jnp.zeros((r,), jnp.int32).at[order].set(jnp.arange(r, dtype=jnp.int32))
    return order, inv


def _exchange_all_to_all(xs, experts, order, counts, wi, wo, act, gmm, ep, tp, p):
    m, h = xs.shape
    e_loc = wi.shape[0]
    axis = _axes_arg(ep)
    send_sizes = counts.reshape(p, e_loc).sum(axis=1)
    send_start = group_starts(send_sizes)
    dest = jnp.take(experts.reshape(-1), order) // e_loc                # destination rank of each sorted row
    rows = jnp.arange(m, dtype=jnp.int32)
    slot = dest * m + rows - jnp.take(send_start, dest)                 # sorted row -> send-buffer slot
    c = jnp.arange(m, dtype=jnp.int32)
    src = (send_start[:, None] + c[None, :]).reshape(-1)                # send-buffer slot -> sorted row
    filled = (c[None, :] < send_sizes[:, None]).reshape(-1)
    always = jnp.ones((m,), bool)
    send = gather_rows(xs, src, filled, slot, always).reshape(p, m, h)
    recv = jax.lax.all_to_all(send, axis, 0, 0)                          # [P source, M, H]
    recv_counts = jax.lax.all_to_all(counts.reshape(p, e_loc), axis, 0, 0)   # [P source, E/P]
    cum = jnp.cumsum(recv_counts, axis=1)
    local_e = jax.vmap(lambda cu: searchsorted(cu, c, side="right"))(cum)   # [P, M]; E/P = empty slot
    order2, inv2 = _regroup(local_e.reshape(-1).astype(jnp.int32))
    every = jnp.ones((p * m,), bool)
    rows2 = gather_rows(recv.reshape(p * m, h), order2, every, inv2, every)
    ys2 = sorted_mlp_psum(rows2, recv_counts.sum(axis=0), wi, wo, act, gmm, tp)
    back = gather_rows(ys2, inv2, every, order2, every).reshape(p, m, h)
    back = jax.lax.all_to_all(back, axis, 0, 0)                          # [P dest, M, H]: my rows' results
    return gather_rows(back.reshape(p * m, h), slot, always, src, filled)


def _exchange_ragged(xs, counts, wi, wo, act, gmm, ep, tp, p):
    m, h = xs.shape
    e_loc = wi.shape[0]
    axis = _axes_arg(ep)
    me = jax.lax.axis_index(axis)
    send_sizes = counts.reshape(p, e_loc).sum(axis=1).astype(jnp.int32)
    send_start = group_starts(send_sizes)
    sizes = jax.lax.all_gather(send_sizes, axis)                         # [P src, P dst]
    starts = jax.lax.all_gather(send_start, axis)                        # [P src, P dst]
    recv_sizes = sizes[:, me]
    recv_start = group_starts(recv_sizes)
    peer_off = jnp.sum(jnp.where(jnp.arange(p)[:, None] < me, sizes, 0), axis=0).astype(jnp.int32)  # my chunk in peer's buffer
    back_off = starts[:, me]                                              # source's rows for me began here
    recv_rows = p * m
    fwd_plan = (send_start, send_sizes, peer_off, recv_sizes)
    recv = _ragged_exchange(xs, fwd_plan, axis, recv_rows)               # [P*M, H], source-major, live first
    recv_counts = jax.lax.all_to_all(counts.reshape(p, e_loc), axis, 0, 0)    # [P source, E/P]
    seg = searchsorted(jnp.cumsum(recv_counts.reshape(-1)), jnp.arange(recv_rows), side="right")
    local_e = jnp.where(seg < p * e_loc, seg % e_loc, e_loc).astype(jnp.int32)
    order2, inv2 = _regroup(local_e)
    every = jnp.ones((recv_rows,), bool)
    rows2 = gather_rows(recv, order2, every, inv2, every)
    ys2 = sorted_mlp_psum(rows2, recv_counts.sum(axis=0), wi, wo, act, gmm, tp)
    back = gather_rows(ys2, inv2, every, order2, every)
    bwd_plan = (recv_start, recv_sizes, back_off, send_sizes)
    return _ragged_exchange(back, bwd_plan, axis, m)


def _ragged_exchange(operand, plan, axis, out_rows):
    """``ragged_all_to_all`` of ``operand`` rows by ``plan = (in_off, send_sz, peer_out_off, recv_sz)``.

    Differentiable through JAX's own transpose rule (the reverse ragged exchange).
    """
    in_off, send_sz, out_off, recv_sz = plan
    # the output takes the type of this buffer: it must vary like the rows it receives
    out = match_vma(jnp.zeros((out_rows,) + operand.shape[1:], operand.dtype), operand)
    return jax.lax.ragged_all_to_all(operand, out, in_off, send_sz, out_off, recv_sz, axis_name=axis)

