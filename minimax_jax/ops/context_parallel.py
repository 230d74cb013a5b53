"""Context parallelism (CP): a layer's attention over a token axis sharded on the mesh's sequence axes; and,
on a mesh without a sequence split, the same ``shard_map`` over each device's rows and heads.

GSPMD cannot split a Pallas kernel or a cuDNN call (an opaque custom call): left to it, every device
gathers the whole sequence and runs the whole kernel. Here the attention runs in ``jax.shard_map``
instead: each device keeps its shard of the queries and of everything per query (index queries,
positions, segment ids), all-gathers the keys, values, index keys and the keys' positions / segment
ids over the sequence axes, and calls the ordinary op on its local queries against the whole key axis.
Masks come from the global positions and segment ids, so packed documents need nothing extra. The
transpose of the all-gather is a reduce-scatter: dK, dV and d ki return summed to the devices that own
them. Per-query outputs stay sharded; scalar sums (the indexer KL) are psum'ed over the query axes.
(Ring attention would overlap the K/V exchange with compute; the all-gather costs S x G x D per layer,
small next to the queries' share for GQA / MSA shapes.)

Local queries against gathered keys (T < S) are served by the MSA kernels (queries may sit anywhere:
``pallas_kernels/msa/layout.py``), by ``"pallas_masked_gpu"`` for dense layers (the ``attention`` op's
``auto`` on GPU for T != S: walks only the key tiles the shard's positions can see) and by the XLA
references elsewhere (CPU, TPU, sliding windows; the implementation report says which ran).

Load balance: with a causal mask a device's work grows with its shard's position (the last shard's
queries see every key), and the MSA kernels skip what is masked. ``forward`` therefore lays the row out
in zig-zag order (``zigzag``: split into 2n chunks, device d holds chunks d and 2n-1-d) for the decoder
layers when 2n divides the row, and restores the natural order before the final norm; inside
``token_order`` the gathered keys are put back in natural order (the MSA kernels' storage contract:
each document's keys one run with positions increasing), the local queries stay where they are
(queries may sit anywhere).

Layout strings name each array's dimensions: ``b`` batch (sharded over the batch rule's mesh axes that
divide it), ``t`` tokens (the sequence axes), ``h`` heads (the ``act_heads`` axes when they divide every
head count of the call, so a kv group's query heads stay with it), ``.`` replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from minimax_jax import sharding
from minimax_jax.ops.registry import record_implementation

__all__ = ["Plan", "plan", "run", "zigzag", "token_order", "current_order", "dividing_axes"]

_state = threading.local()


def zigzag(tokens: int, n: int) -> np.ndarray:
    """Zig-zag token order for ``n`` sequence shards: int32 ``[tokens]`` permutation whose contiguous
    n-way split gives shard d the chunks d and 2n-1-d of 2n equal chunks. Needs ``tokens % (2n) == 0``."""
    if tokens % (2 * n):
        raise ValueError(f"zigzag: {tokens} tokens do not split into 2 x {n} equal chunks")
    c = tokens // (2 * n)
    chunks = np.arange(tokens, dtype=np.int32).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * n - 1 - d]]) for d in range(n)])


@contextlib.contextmanager
def token_order(perm: np.ndarray | None) -> Iterator[None]:
    """While tracing the layers of a row laid out in order ``perm`` (row slot i holds token perm[i]), the
    CP calls put gathered keys back in natural order. ``None``: natural order. Nestable."""
    prev = getattr(_state, "order", None)
    _state.order = None if perm is None else np.asarray(perm)
    try:
        yield
    finally:
        _state.order = prev


def current_order() -> np.ndarray | None:
    """The token order set by ``token_order`` (None: natural)."""
    return getattr(_state, "order", None)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Mesh axes of one context-parallel call: ``seq`` (tokens), ``batch``, ``heads``; ``tokens``: the row
    length it was planned for."""
    mesh: jax.sharding.Mesh
    tokens: int
    seq: tuple[str, ...]
    batch: tuple[str, ...]
    heads: tuple[str, ...]

    @property
    def size(self) -> int:
        return sharding.mesh_axis_size(self.mesh, self.seq)

    @property
    def query_axes(self) -> tuple[str, ...]:
        """Every mesh axis a per-query sum is partitioned over."""
        return self.batch + self.seq + self.heads

    def spec(self, layout: str) -> PS:
        axes = {"b": self.batch, "t": self.seq, "h": self.heads}
        return PS(*[(axes.get(c) or None) for c in layout])


def dividing_axes(mesh, axes: Sequence[str], n: int, used: set[str]) -> tuple[str, ...]:
    """The leading run of ``axes`` (size > 1, not in ``used``) whose product divides ``n``."""
    out: list[str] = []
    for a in axes:
        if a in used or mesh.shape[a] == 1:
            continue
        if n % (math.prod(mesh.shape[x] for x in out) * mesh.shape[a]):
            break
        out.append(a)
    return tuple(out)


def plan(batch: int, tokens: int, head_counts: Sequence[int]) -> Plan | None:
    """The plan for a call with ``batch`` rows of ``tokens`` tokens on the active mesh, or None (no
    ``use_mesh`` context, or no mesh axis of size > 1 that divides the rows, the tokens or the heads).

    Context parallelism when the ``length`` rule's axes (size > 1) divide ``tokens``; otherwise ``seq`` is
    empty and the call still runs in ``shard_map`` on its local rows and heads (the kernels are opaque custom
    calls: left to GSPMD on a data- or fsdp-sharded mesh, every device would gather the global batch and
    run the whole kernel). ``head_counts``: the call's head counts (q heads, kv heads, ...); heads are
    sharded over the ``act_heads`` rule's axes only when these divide every count."""
    ctx = sharding.current()
    if ctx is None:
        return None
    mesh, rules = ctx
    seq = tuple(a for a in rules["length"] if mesh.shape[a] > 1)
    if seq and tokens % sharding.mesh_axis_size(mesh, seq):
        seq = ()
    b = dividing_axes(mesh, rules["batch"], batch, set(seq))
    heads = dividing_axes(mesh, rules["act_heads"], math.gcd(*head_counts), set(seq) | set(b))
    if not (seq or b or heads):
        return None
    return Plan(mesh, tokens, seq, b, heads)


def run(p: Plan, fn: Callable, q_side: Sequence[tuple[jax.Array, str]], kv_side: Sequence[tuple[jax.Array, str]],
        out_layouts: Sequence[str], num_sums: int = 0, name: str = "attention"):
    """``fn(*local q-side arrays, *gathered kv-side arrays) -> (*outputs, *sums)`` in ``shard_map``.

    Args:
      p: from ``plan``. q_side / kv_side: ``(array, layout)`` pairs; every layout has one ``t``; kv-side
        arrays are all-gathered along it inside. out_layouts: the layouts of ``fn``'s array outputs (each
        with its local ``t`` = the queries'); num_sums: trailing scalar outputs, psum'ed over the query axes.
      name: recorded under ``context_parallel/<name>`` in the implementation report.
    Returns: the outputs (sharded like the queries) and the summed scalars.
    """
    nq = len(q_side)
    gather_axes = [layout.index("t") for _, layout in kv_side]
    order = current_order()
    inverse = None if order is None else jnp.asarray(np.argsort(order).astype(np.int32))
    # Without a sequence split nothing is gathered: a kv-side array that is a q-side one (the positions and
    # segment ids of self-attention) enters once, so the op inside sees one array (the flash kernels'
    # "same positions" check is by identity under jit).
    same = [next((i for i, (y, ly) in enumerate(q_side) if y is x and ly == lay), None) if not p.seq else None
            for x, lay in kv_side]
    kv_in = [(x, lay) for (x, lay), j in zip(kv_side, same) if j is None]

    def body(*args):
        q_loc, rest = args[:nq], iter(args[nq:])
        kv = [q_loc[j] if j is not None else next(rest) for j in same]
        if p.seq:
            kv = [jax.lax.all_gather(x, p.seq, axis=ax, tiled=True) for x, ax in zip(kv, gather_axes)]
        if inverse is not None:                                  # keys back in natural order
            kv = [jnp.take(x, inverse, axis=ax) for x, ax in zip(kv, gather_axes)]
        res = fn(*q_loc, *kv)
        outs, sums = res[:len(res) - num_sums], res[len(res) - num_sums:]
        return (*outs, *(jax.lax.psum(s, p.query_axes) for s in sums))

    record_implementation(f"context_parallel/{name}", f"sequence={p.size},batch={p.batch or '-'},"
                                                      f"heads={p.heads or '-'},"
                                                      f"order={'natural' if order is None else 'zigzag'}")
    # check_vma=False: the kernels' pallas_calls return invariant-typed values (see pallas_kernels.common);
    # every input here is sharded or replicated consistently, so the plain transpose rules are exact.
    fn_sm = jax.shard_map(body, mesh=p.mesh, in_specs=tuple(p.spec(lay) for _, lay in (*q_side, *kv_in)),
                          out_specs=(*(p.spec(lay) for lay in out_layouts), *([PS()] * num_sums)), check_vma=False)
    return fn_sm(*(x for x, _ in q_side), *(x for x, _ in kv_in))
