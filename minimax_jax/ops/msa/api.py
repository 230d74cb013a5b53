"""The public MSA ops: argument validation (once, here) and the registry entries of every op.

Math: MSA_SPEC.md (restating arXiv 2606.13392). Masks follow docs/ARCHITECTURE.md: key ``j`` is
visible to query ``i`` iff ``kv_seg[j] == q_seg[i] and kv_seg[j] >= 0 and kv_pos[j] <= q_pos[i]``;
a key's block is ``kv_pos // block_size`` and a query's local block is ``q_pos // block_size``.
With ``kv_subtree_end`` ``[B, S]`` (prefix-tree rows, ``minimax_jax.data.prefix_tree``; needs T == S)
key slot ``j`` is visible only to query slots ``j <= i < kv_subtree_end[j]`` as well, so every op sees
each query's own trajectory (its blocks are those of the unmerged trajectory); only ``"xla"`` serves it,
and for ``indexer_kl``'s dense warm-up (``block_ids=None``) the GPU kernels too.
The number of key blocks is ``NB = ceil(S / block_size)``, so key positions must lie in
``[0, NB * block_size)`` (checked when the positions are concrete; under ``jit`` keys past that
range are never selected).

Implementations (``minimax_jax.ops.registry``; what ran is recorded under the op's name):
- ``"xla"``: the chunked plain-JAX reference (``reference.py`` / ``kl.py``); runs everywhere;
  memory O(chunk_size * S) per call, also in reverse mode. ``chunk_size`` tunes only this one.
- ``"pallas_gpu"``, ``"pallas_tpu"``, ``"pallas_gpu_interpret"``, ``"pallas_tpu_interpret"``: the
  kernels of ``pallas_kernels.msa`` (``pallas.py`` says when each applies); not for
  ``msa_index_scores``.
- ``"pallas_hopper_gpu"`` (``"pallas_hopper_gpu_interpret"``): the Hopper kernel set (``pallas.py``).
- ``"auto"``: ``"xla"`` on CPU; on GPU ``"pallas_hopper_gpu"`` (``indexer_kl``: its Triton kernel, named
  ``"pallas_gpu"``), then ``"pallas_gpu"``, on TPU ``"pallas_tpu"``,
  each when its ``supports`` accepts the call, else ``"xla"``; the reasons of the ones passed over are
  recorded under ``"<op>.auto_reason"``.
An explicit implementation that cannot serve the call raises ``ImplementationUnavailable``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.ops import registry
from minimax_jax.ops.msa import common as _common
from minimax_jax.ops.msa import kl as _kl
from minimax_jax.ops.msa import pallas as _pallas
from minimax_jax.ops.msa import reference as _ref
from minimax_jax.ops.registry import Implementation

__all__ = ["msa_index_scores", "msa_select_blocks", "msa_attention", "indexer_kl", "IMPLEMENTATIONS",
           "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = 256


# ----------------------------------------------------------------------------- validation

def _check_float(name: str, x, ndim: int, op: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: {name} must be a floating dtype, got {x.dtype}")


def _check_int(name: str, x, shape: tuple, op: str) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an integer array of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{op}: {name} must be an integer dtype, got {x.dtype}")
    return jnp.asarray(x, jnp.int32)


def _block_ids(x, shape: tuple, op: str, num_keys: int, block_size: int) -> jax.Array:
    """Checked block ids as int32 with every id outside ``[0, NB)`` set to ``-1`` (an empty slot).

    The XLA reference selects nothing for such ids; blanking them here gives every kernel the same
    meaning (a kernel would otherwise form ``id * block_size`` offsets that overflow int32).
    """
    ids = _check_int("block_ids", x, shape, op)
    nb = _common.num_key_blocks(num_keys, block_size)
    return jnp.where((ids >= 0) & (ids < nb), ids, -1)


def _check_pos_int(name: str, value, op: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _concrete(x):
    """``np.ndarray`` of ``x`` when it holds values (outside jit), else None (a tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _masks(op, b, t, s, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size):
    """Validate positions / segment ids; fill missing segment ids with zeros. Returns int32 arrays."""
    if q_positions is None or kv_positions is None:
        raise ValueError(f"{op}: q_positions [B, T] and kv_positions [B, S] are required")
    q_pos = _check_int("q_positions", q_positions, (b, t), op)
    kv_pos = _check_int("kv_positions", kv_positions, (b, s), op)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{op}: pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is None:
        q_seg = jnp.zeros((b, t), jnp.int32)
        kv_seg = jnp.zeros((b, s), jnp.int32)
    else:
        q_seg = _check_int("q_segment_ids", q_segment_ids, (b, t), op)
        kv_seg = _check_int("kv_segment_ids", kv_segment_ids, (b, s), op)
    kp = _concrete(kv_pos) if block_size is not None else None
    ks = _concrete(kv_seg) if kp is not None else None
    if kp is not None and ks is not None:
        nb = -(-s // block_size)
        used = ks >= 0
        if used.any() and (kp[used].min() < 0 or kp[used].max() >= nb * block_size):
            raise ValueError(
                f"{op}: kv_positions of valid keys must lie in [0, ceil(S / block_size) * block_size) = "
                f"[0, {nb * block_size}); got [{kp[used].min()}, {kp[used].max()}]")
    return q_pos, kv_pos, q_seg, kv_seg


def _tree(op, kv_subtree_end, b: int, t: int, s: int) -> dict:
    """Checked prefix-tree visibility as the dispatch keyword (``{}`` when None)."""
    if kv_subtree_end is None:
        return {}
    if t != s:
        raise ValueError(f"{op}: kv_subtree_end (prefix-tree visibility) needs self-attention T == S, got T={t}, S={s}")
    return {"kv_subtree_end": _check_int("kv_subtree_end", kv_subtree_end, (b, s), op)}


def _check_chunk(op, chunk_size):
    if chunk_size is None:
        return DEFAULT_CHUNK_SIZE
    return _check_pos_int("chunk_size", chunk_size, op)


def _check_index(op, qi, ki):
    _check_float("qi", qi, 4, op)
    _check_float("ki", ki, 3, op)
    b, t, hi, di = qi.shape
    if ki.shape[0] != b or ki.shape[2] != di:
        raise ValueError(f"{op}: ki must have shape [B={b}, S, Di={di}], got {tuple(ki.shape)}")
    if t < 1 or ki.shape[1] < 1:
        raise ValueError(f"{op}: need T >= 1 and S >= 1, got T={t}, S={ki.shape[1]}")
    return b, t, hi, di, ki.shape[1]


def _check_main(op, q, k, v=None):
    _check_float("q", q, 4, op)
    _check_float("k", k, 4, op)
    b, t, h, d = q.shape
    _, s, g, dk = k.shape
    if k.shape[0] != b or dk != d:
        raise ValueError(f"{op}: k must have shape [B={b}, S, G, D={d}], got {tuple(k.shape)}")
    if v is not None:
        _check_float("v", v, 4, op)
        if tuple(v.shape[:3]) != (b, s, g):
            raise ValueError(f"{op}: v must have shape [B={b}, S={s}, G={g}, Dv], got {tuple(v.shape)}")
    if g < 1 or h % g:
        raise ValueError(f"{op}: query heads H={h} must be a multiple of kv heads G={g}")
    if t < 1 or s < 1:
        raise ValueError(f"{op}: need T >= 1 and S >= 1, got T={t}, S={s}")
    return b, t, h, d, s, g


# ----------------------------------------------------------------------------- public ops

def msa_index_scores(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                     block_size: int, implementation: str = "xla", chunk_size: int | None = None,
                     kv_subtree_end=None) -> jax.Array:
    """MSA block scores (for inspection and tests).

    ``s[r, i, j] = <qi[i, r], ki[j]> / sqrt(Di)`` for visible keys; the block score is the max of
    ``s`` over the visible keys of each block (MSA_SPEC.md section 1).

    Args:
      qi: ``[B, T, Hi, Di]`` float index queries (one head per kv group).
      ki: ``[B, S, Di]`` float index keys (one head shared by all groups).
      q_positions: ``[B, T]`` int; kv_positions: ``[B, S]`` int.
      q_segment_ids, kv_segment_ids: ``[B, T]`` / ``[B, S]`` int or both None (one segment);
        ``kv_segment_ids < 0`` marks empty key slots.
      block_size: tokens per block (> 0).
      implementation: ``"xla"`` or ``"auto"`` (no kernel). chunk_size: queries per step of the xla reference.
      kv_subtree_end: ``[B, S]`` int or None: prefix-tree visibility (module docstring; T == S).
    Returns: ``[B, Hi, T, NB]`` float32, ``NB = ceil(S / block_size)``; ``-inf`` for blocks without
      a visible key (all blocks after the query's local block, other documents, empty slots).
    Raises: ValueError / TypeError for bad shapes, dtypes or sizes; ImplementationUnavailable.
    """
    op = "msa_index_scores"
    b, t, hi, di, s = _check_index(op, qi, ki)
    block_size = _check_pos_int("block_size", block_size, op)
    chunk = _check_chunk(op, chunk_size)
    q_pos, kv_pos, q_seg, kv_seg = _masks(op, b, t, s, q_positions, kv_positions, q_segment_ids,
                                          kv_segment_ids, block_size)
    return registry.dispatch(op, implementation, qi, ki, q_positions=q_pos, kv_positions=kv_pos,
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_size=block_size, chunk_size=chunk,
                             **_tree(op, kv_subtree_end, b, t, s))


def msa_select_blocks(qi, ki, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                      block_size: int, topk: int, init_blocks: int = 0, local_blocks: int = 1,
                      implementation: str = "xla", chunk_size: int | None = None,
                      kv_subtree_end=None) -> jax.Array:
    """MSA block selection per query token and per group (MSA_SPEC.md section 2).

    The local block ``q_pos // block_size`` is always kept, with the ``init_blocks`` first blocks
    and the ``local_blocks - 1`` blocks before the local one (both off in M3); the remaining slots
    take the best complete blocks before the local one by block score (``msa_index_scores``).
    Only blocks holding a visible key are eligible, so ``valid = min(K, local + 1)`` and a context
    of at most ``K * block_size`` tokens selects every block (MSA == dense causal attention).

    Args: as ``msa_index_scores``, plus ``topk`` (K >= 1), ``init_blocks`` (>= 0),
      ``local_blocks`` (>= 1), with ``init_blocks + local_blocks <= topk``.
      kv_subtree_end: ``[B, S]`` int or None: prefix-tree visibility (module docstring; T == S).
    Returns: ``[B, Hi, T, K]`` int32 block ids, ``-1`` padded. Reference order ("xla"): forced
      non-local blocks (ascending), then by score descending with ties to the lower block id, then
      the local block in the last valid slot. Kernels may order slots differently: compare SETS.
      No gradient flows through the selection (it is discrete).
    Raises: ValueError / TypeError for bad inputs; ImplementationUnavailable.
    """
    op = "msa_select_blocks"
    b, t, hi, di, s = _check_index(op, qi, ki)
    block_size = _check_pos_int("block_size", block_size, op)
    topk = _check_pos_int("topk", topk, op)
    init_blocks = _check_pos_int("init_blocks", init_blocks, op, minimum=0)
    local_blocks = _check_pos_int("local_blocks", local_blocks, op)
    if init_blocks + local_blocks > topk:
        raise ValueError(f"{op}: init_blocks + local_blocks = {init_blocks + local_blocks} exceeds topk = {topk}")
    chunk = _check_chunk(op, chunk_size)
    q_pos, kv_pos, q_seg, kv_seg = _masks(op, b, t, s, q_positions, kv_positions, q_segment_ids,
                                          kv_segment_ids, block_size)
    return registry.dispatch(op, implementation, qi, ki, q_positions=q_pos, kv_positions=kv_pos,
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_size=block_size, topk=topk,
                             init_blocks=init_blocks, local_blocks=local_blocks, chunk_size=chunk,
                             **_tree(op, kv_subtree_end, b, t, s))


def msa_attention(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                  block_size: int, implementation: str = "xla",
                  chunk_size: int | None = None, kv_subtree_end=None) -> tuple[jax.Array, jax.Array]:
    """Block-sparse GQA attention over selected key blocks (MSA_SPEC.md section 3).

    Query head ``h`` (group ``r = h // (H / G)``) attends the visible keys of the blocks
    ``block_ids[b, r, i, :]`` (causal inside the local block), with scale ``1/sqrt(D)`` and an
    exact float32 softmax.

    Args:
      q: ``[B, T, H, D]``; k: ``[B, S, G, D]``; v: ``[B, S, G, Dv]`` float (any float dtype).
      block_ids: ``[B, G, T, K]`` int block ids (``-1`` = empty slot; duplicates count once).
      q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size, kv_subtree_end: as
        ``msa_index_scores``.
    Returns: ``(o [B, T, H, Dv] in q.dtype, lse [B, T, H] float32)`` with ``lse`` the natural-log
      sum-exp of the scaled logits over the attended keys; a query with no attended key gets
      ``o = 0`` and ``lse = -inf``.
    Raises: ValueError / TypeError for bad inputs; ImplementationUnavailable.
    """
    op = "msa_attention"
    b, t, h, d, s, g = _check_main(op, q, k, v)
    block_size = _check_pos_int("block_size", block_size, op)
    chunk = _check_chunk(op, chunk_size)
    if not hasattr(block_ids, "shape") or block_ids.ndim != 4 or tuple(block_ids.shape[:3]) != (b, g, t):
        raise ValueError(f"{op}: block_ids must have shape [B={b}, G={g}, T={t}, K], "
                         f"got {tuple(getattr(block_ids, 'shape', ()))}")
    ids = _block_ids(block_ids, block_ids.shape, op, s, block_size)
    q_pos, kv_pos, q_seg, kv_seg = _masks(op, b, t, s, q_positions, kv_positions, q_segment_ids,
                                          kv_segment_ids, block_size)
    return registry.dispatch(op, implementation, q, k, v, ids, q_positions=q_pos, kv_positions=kv_pos,
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_size=block_size, chunk_size=chunk,
                             **_tree(op, kv_subtree_end, b, t, s))


def indexer_kl(q, k, qi, ki, block_ids, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
               block_size: int | None = None, implementation: str = "xla",
               chunk_size: int | None = None, kv_subtree_end=None,
               q_weights=None, teacher_lse=None) -> tuple[jax.Array, jax.Array]:
    """Indexer KL loss on the selected support (MSA_SPEC.md section 4), un-normalised.

    For each (batch, query i, group r) with support ``U`` (the visible keys of the selected blocks,
    or every visible key when ``block_ids is None``: the dense warm-up), the teacher is the mean over
    the group's ``H/G`` heads of ``softmax_U(q_h . k / sqrt(D))`` (stop_gradient) and the student is
    ``softmax_U(qi_r . ki / sqrt(Di))``; the term is ``KL(teacher || student)``.

    Args:
      q: ``[B, T, H, D]``, k: ``[B, S, G, D]`` main-branch queries / keys (receive no gradient).
      qi: ``[B, T, Hi, Di]`` with ``Hi == G``; ki: ``[B, S, Di]`` (gradients reach only these).
      block_ids: ``[B, Hi, T, K]`` int (from ``msa_select_blocks``) or None for the dense warm-up (on the
        GPU implementations the flash-style kernels of ``pallas_kernels.msa.gpu_kl_dense``, which also take
        ``kv_subtree_end``; the TPU kernels refuse it).
      positions / segment ids, kv_subtree_end: as ``msa_index_scores``; block_size: required with
        ``block_ids``.
      q_weights: ``[B, T]`` float or None: each query's rows count ``q_weights[b, i]`` times in the sum
        and the count (prefix-tree rows: how many unmerged input positions a slot stands for).
      teacher_lse: ``[B, T, H]`` float32 or None: each head's natural-log LSE over the same support,
        i.e. ``msa_attention``'s second output for these ``block_ids`` (no gradient; sparse only). The
        sparse GPU kernel then skips recomputing it (the main-branch logits of its first pass); the other
        implementations compute their own (the result is the same up to rounding).
    Returns: ``(kl_sum float32 [], count [])``: the sum over (b, i, r) and the number of
      (b, i, r) with a non-empty support (``Hi * T`` for ordinary inputs; int32, or float32 with
      ``q_weights``, then the weighted count). The training loss is
      ``coeff * kl_sum / (Hi * T_total)``; the gradient wrt one row's student logits is
      ``p_student - p_teacher``.
    Raises: ValueError / TypeError for bad inputs; ImplementationUnavailable.
    """
    op = "indexer_kl"
    b, t, h, d, s, g = _check_main(op, q, k)
    bi, ti, hi, di, si = _check_index(op, qi, ki)
    if (bi, ti, si) != (b, t, s):
        raise ValueError(f"{op}: qi/ki batch, T, S ({bi}, {ti}, {si}) must match q/k ({b}, {t}, {s})")
    if hi != g:
        raise ValueError(f"{op}: index heads Hi={hi} must equal kv heads G={g} (one index head per group)")
    chunk = _check_chunk(op, chunk_size)
    ids = None
    if block_ids is not None:
        if block_size is None:
            raise ValueError(f"{op}: block_size is required when block_ids is given")
        block_size = _check_pos_int("block_size", block_size, op)
        if not hasattr(block_ids, "shape") or block_ids.ndim != 4 or tuple(block_ids.shape[:3]) != (b, hi, t):
            raise ValueError(f"{op}: block_ids must have shape [B={b}, Hi={hi}, T={t}, K], "
                             f"got {tuple(getattr(block_ids, 'shape', ()))}")
        ids = _block_ids(block_ids, block_ids.shape, op, s, block_size)
    elif block_size is not None:
        block_size = _check_pos_int("block_size", block_size, op)
    q_pos, kv_pos, q_seg, kv_seg = _masks(op, b, t, s, q_positions, kv_positions, q_segment_ids,
                                          kv_segment_ids, block_size if ids is not None else None)
    extra = _tree(op, kv_subtree_end, b, t, s)
    if q_weights is not None:
        _check_float("q_weights", q_weights, 2, op)
        if tuple(q_weights.shape) != (b, t):
            raise ValueError(f"{op}: q_weights must have shape [B={b}, T={t}], got {tuple(q_weights.shape)}")
        extra["q_weights"] = q_weights
    if teacher_lse is not None:
        if ids is None:
            raise ValueError(f"{op}: teacher_lse needs block_ids (the sparse support's attention LSE)")
        _check_float("teacher_lse", teacher_lse, 3, op)
        if tuple(teacher_lse.shape) != (b, t, h):
            raise ValueError(f"{op}: teacher_lse must have shape [B={b}, T={t}, H={h}], got {tuple(teacher_lse.shape)}")
        extra["teacher_lse"] = teacher_lse
    return registry.dispatch(op, implementation, q, k, qi, ki, ids, q_positions=q_pos, kv_positions=kv_pos,
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_size=block_size, chunk_size=chunk,
                             **extra)


# ----------------------------------------------------------------------------- registry

def _xla(reference_fn):
    """The registry's view of a reference function: masks as keywords, as ``dispatch`` passes them."""
    def run(*arrays, q_positions, kv_positions, q_segment_ids, kv_segment_ids, **static):
        return reference_fn(*arrays, q_positions, kv_positions, q_segment_ids, kv_segment_ids, **static)
    return run


def _kernel_then_xla(backend, *args, **kwargs):
    """``"auto"``: the backend's kernel when it serves the call, else the XLA reference."""
    return {"gpu": ("pallas_hopper_gpu", "pallas_gpu", "xla"), "tpu": ("pallas_tpu", "xla")}.get(backend, ("xla",))


def _kl_kernel_then_xla(backend, *args, **kwargs):
    """``"auto"`` for the KL: the Hopper set runs the Triton KL, so on GPU it is named ``pallas_gpu``."""
    return ("pallas_gpu", "xla") if backend == "gpu" else _kernel_then_xla(backend)


registry.register("msa_index_scores", [Implementation("xla", _xla(_ref.index_scores))],
                  auto=lambda backend, *args, **kwargs: ("xla",))
registry.register("msa_select_blocks", [Implementation("xla", _xla(_ref.select_blocks)), *_pallas.SELECT_BLOCKS],
                  auto=_kernel_then_xla)
registry.register("msa_attention", [Implementation("xla", _xla(_ref.attention)), *_pallas.ATTENTION],
                  auto=_kernel_then_xla)


def _kl_xla(*arrays, teacher_lse=None, **kw):
    """The reference computes the teacher's LSE itself (``teacher_lse`` is an optimisation of the kernel)."""
    return _xla(_kl.indexer_kl)(*arrays, **kw)


registry.register("indexer_kl", [Implementation("xla", _kl_xla), *_pallas.INDEXER_KL],
                  auto=_kl_kernel_then_xla)

#: Every ``implementation=`` name of the MSA ops that take kernels (``"auto"`` first).
IMPLEMENTATIONS = registry.implementation_names("msa_attention")
