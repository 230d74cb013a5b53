"""Prefix-tree packing: trajectories that share token prefixes are laid out once, with exact loss weights.

The trajectories of one step are merged into the prefix trie of their token ids (one trie node per
token). Each tree (trajectories with the same first token) is laid out in DFS preorder: the
lexicographically sorted trajectories, each contributing the tokens past its longest common prefix
with the one before. Trees go into rows of ``seq_len`` slots, first-fit by decreasing size, several
per row when they fit.

A tree larger than ``seq_len`` is cut into groups of consecutive (sorted) trajectories whose tries
fit; each group is its own tree, so the prefix the groups share is laid out once per group
(duplicated), never dropped. A single trajectory longer than ``seq_len`` raises ``TreePackingError``.

Row layout (numpy, ``[R, L]``; ``s`` is a slot, i.e. a storage index in its row)::

    tokens       int32  the token of slot s
    positions    int32  its position in its own trajectory (depth in the trie; RoPE)
    segment_ids  int32  1-based tree index in the row, 0 = padding
    subtree_end  int32  one past the last slot of s's subtree: key slot j is visible to query slot i
                        iff j <= i < subtree_end[j] (j is i or an ancestor of i); padding: s + 1
    targets      int32  = tokens: the token slot s holds, predicted from the logits of slot loss_index[s]
    loss_index   int32  slot of s's parent (the previous token of every trajectory through s); s itself
                        for roots and padding
    loss_mask    f32    sum over the trajectories through s of their mask of this token (0 on roots and
                        padding), so sum(loss_mask * CE) over the rows equals the sum over the unmerged
                        trajectories, and sum(loss_mask) their token count: the losses normalised by it
                        are equal
    input_weight f32    how many unmerged input positions slot s stands for: the trajectories through s
                        that continue past it (0 on padding and on slots only ever a last token); the
                        weight of per-input terms that are not CE targets (the MSA indexer KL rows)

With ``key_len`` the rows also carry a per-trajectory KEY layout ``[R, key_len]`` for attention kernels
that take queries apart from keys (MSA): every trajectory of the row (in layout order) as its own
document, its root-to-leaf path of slots one contiguous run (gathered from the row's slots), so the
trajectory's tokens sit at their own positions as in the unmerged batch::

    key_slot            int32  the row slot a key entry is gathered from (0 on padding)
    key_positions       int32  its position in its trajectory (0..n-1)
    key_segment_ids     int32  1-based trajectory index in the row, -1 = padding
    query_segment_ids   int32  [R, L]: the key segment of the trajectory that laid slot s out (the one it
                               is new in; s sees that trajectory's prefix = its own ancestors), -1 padding

``merge=False`` lays out every trajectory as its own chain (no sharing): the unmerged baseline with the
same layout. Ancestor intervals per slot (for kernels): the ancestors of slot i are the slots j <= i
with subtree_end[j] > i; along a path they form at most depth(i) + 1 runs of consecutive slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["Trajectory", "TreePackingError", "PackStats", "plan_groups", "pack_trajectories", "ROW_KEYS", "KEY_KEYS",
           "ancestor_mask"]

ROW_KEYS = ("tokens", "targets", "positions", "segment_ids", "subtree_end", "loss_index", "loss_mask",
            "input_weight")
KEY_KEYS = ("key_slot", "key_positions", "key_segment_ids", "query_segment_ids")
FLOAT_KEYS = ("loss_mask", "input_weight")


class TreePackingError(ValueError):
    """Trajectories do not fit the rows (one longer than ``seq_len``, or more rows needed than given)."""


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One trajectory: ``tokens`` int32 ``[n]`` and ``loss_mask`` float32 ``[n]`` (the weight of token i
    as a prediction target; entry 0 is never used: the first token has no predecessor)."""

    tokens: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self):
        t = np.asarray(self.tokens, np.int32).reshape(-1)
        m = np.asarray(self.loss_mask, np.float32).reshape(-1)
        if t.shape != m.shape or t.size == 0:
            raise ValueError(f"trajectory tokens {t.shape} and loss_mask {m.shape} must be equal and non-empty")
        object.__setattr__(self, "tokens", t)
        object.__setattr__(self, "loss_mask", m)


@dataclasses.dataclass(frozen=True)
class PackStats:
    """tokens_before: sum of the trajectories' lengths; tokens_after: slots used; rows: rows holding a tree."""

    tokens_before: int
    tokens_after: int
    rows: int

    @property
    def saving(self) -> float:
        """Fraction of slots merging saves (``1 - after / before``)."""
        return 1.0 - self.tokens_after / max(self.tokens_before, 1)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def plan_groups(trajs: Sequence[Trajectory], seq_len: int, merge: bool = True) -> list[list[tuple[int, int]]]:
    """The trees to lay out: lists of ``(trajectory index, lcp with the previous one in the group)`` in
    DFS (sorted) order, each tree at most ``seq_len`` slots (module docstring).

    Raises TreePackingError for a trajectory longer than ``seq_len``.
    """
    for i, t in enumerate(trajs):
        if t.tokens.size > seq_len:
            raise TreePackingError(f"trajectory {i} has {t.tokens.size} tokens, more than seq_len={seq_len}")
    order = sorted(range(len(trajs)), key=lambda i: tuple(trajs[i].tokens.tolist())) if merge else range(len(trajs))
    groups: list[list[tuple[int, int]]] = []
    size, prev = 0, None
    for i in order:
        n = trajs[i].tokens.size
        lcp = _lcp(trajs[prev].tokens, trajs[i].tokens) if (merge and prev is not None) else 0
        if lcp == 0 or size + n - lcp > seq_len:
            groups.append([(i, 0)])
            size = n
        else:
            groups[-1].append((i, lcp))
            size += n - lcp
        prev = i
    return groups


def _group_size(trajs, group) -> int:
    return sum(trajs[i].tokens.size - lcp for i, lcp in group)


def _assign_rows(sizes: list[int], seq_len: int, num_rows: int | None) -> list[int]:
    """First-fit decreasing: the row of each group. Raises TreePackingError past ``num_rows``."""
    free: list[int] = []
    row_of = [0] * len(sizes)
    for g in sorted(range(len(sizes)), key=lambda g: -sizes[g]):
        r = next((r for r, f in enumerate(free) if f >= sizes[g]), None)
        if r is None:
            free.append(seq_len)
            r = len(free) - 1
        free[r] -= sizes[g]
        row_of[g] = r
    if num_rows is not None and len(free) > num_rows:
        raise TreePackingError(f"the trajectories need {len(free)} rows of {seq_len} slots, only {num_rows} given")
    return row_of


def _layout(trajs, group, out: dict[str, np.ndarray], row: int, base: int, seg: int, paths: list) -> int:
    """Writes one tree into ``out[*][row]`` from slot ``base``; returns the slot after it. Appends each
    trajectory's ``(path slots, new slots)`` to ``paths``."""
    depth = max(trajs[i].tokens.size for i, _ in group)
    path = np.zeros(depth, np.int64)     # slot of each depth on the current trajectory's path
    cur, prev_len = base, 0
    for i, lcp in group:
        t, m = trajs[i].tokens, trajs[i].loss_mask
        n = t.size
        assert lcp <= min(n, prev_len)
        out["subtree_end"][row, path[lcp:prev_len]] = cur       # the previous path's branch closes here
        new = np.arange(cur, cur + n - lcp)
        path[lcp:n] = new
        out["tokens"][row, new] = t[lcp:]
        out["positions"][row, new] = np.arange(lcp, n)
        out["segment_ids"][row, new] = seg
        parents = path[np.arange(lcp, n) - 1]
        out["loss_index"][row, new] = np.where(np.arange(lcp, n) == 0, new, parents)
        out["loss_mask"][row, path[1:n]] += m[1:]
        out["input_weight"][row, path[:n - 1]] += 1.0
        paths.append((path[:n].copy(), new))
        cur, prev_len = cur + n - lcp, n
    out["subtree_end"][row, path[:prev_len]] = cur
    return cur


def _key_layout(row_paths: list[list], rows: int, seq_len: int, key_len: int) -> dict[str, np.ndarray]:
    """The KEY_KEYS arrays (module docstring) of the rows' trajectory paths."""
    out = {k: np.zeros((rows, key_len), np.int32) for k in KEY_KEYS if k != "query_segment_ids"}
    out["key_segment_ids"][:] = -1
    out["query_segment_ids"] = np.full((rows, seq_len), -1, np.int32)
    for r, paths in enumerate(row_paths):
        need = sum(p.size for p, _ in paths)
        if need > key_len:
            raise TreePackingError(f"row {r} needs {need} key entries (its trajectories unmerged), more than "
                                   f"key_len={key_len}")
        o = 0
        for i, (path, new) in enumerate(paths, start=1):
            n = path.size
            out["key_slot"][r, o:o + n] = path
            out["key_positions"][r, o:o + n] = np.arange(n)
            out["key_segment_ids"][r, o:o + n] = i
            out["query_segment_ids"][r, new] = i
            o += n
    return out


def pack_trajectories(trajs: Sequence[Trajectory], seq_len: int, num_rows: int | None = None,
                      merge: bool = True, key_len: int | None = None) -> tuple[dict[str, np.ndarray], PackStats]:
    """Packs ``trajs`` into ``[num_rows, seq_len]`` rows (module docstring; ``num_rows=None``: as many
    as needed; ``key_len``: also the key layout, ``KEY_KEYS``). Returns ``(rows, stats)``. Raises
    TreePackingError when they do not fit (rows, or ``key_len`` key entries per row)."""
    if not trajs:
        raise TreePackingError("no trajectories to pack")
    groups = plan_groups(trajs, seq_len, merge)
    sizes = [_group_size(trajs, g) for g in groups]
    row_of = _assign_rows(sizes, seq_len, num_rows)
    rows = num_rows if num_rows is not None else max(row_of) + 1
    slot = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
    out = {k: np.zeros((rows, seq_len), np.float32 if k in FLOAT_KEYS else np.int32) for k in ROW_KEYS}
    out["subtree_end"][:] = slot + 1
    out["loss_index"][:] = slot
    fill = [0] * rows
    segs = [0] * rows
    row_paths: list[list] = [[] for _ in range(rows)]
    for g, group in enumerate(groups):
        r = row_of[g]
        segs[r] += 1
        fill[r] = _layout(trajs, group, out, r, fill[r], segs[r], row_paths[r])
    out["targets"] = out["tokens"].copy()
    if key_len is not None:
        out.update(_key_layout(row_paths, rows, seq_len, key_len))
    before = int(sum(t.tokens.size for t in trajs))
    return out, PackStats(before, int(sum(sizes)), len(set(row_of)))


def ancestor_mask(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Boolean ``[R, L, L]`` visibility (query slot, key slot) of packed rows: ``j <= i < subtree_end[j]``."""
    end = rows["subtree_end"]
    i = np.arange(end.shape[1])
    return (i[None, None, :] <= i[None, :, None]) & (i[None, :, None] < end[:, None, :])
