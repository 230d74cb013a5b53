"""Launch configuration of the GPU decode kernels: the read-only default table and how a call's launch
is resolved.

``LaunchTable`` is a frozen table of launch defaults; ``DEFAULT_TABLE`` holds the tuned ones. The kernel
entry points of ``gpu_select`` and ``gpu_attention`` take ``table=`` (None = ``DEFAULT_TABLE``); a caller
that wants other launches passes a table of its own (``dataclasses.replace(DEFAULT_TABLE, ...)``).
``score_launch`` resolves the page-scoring kernel's launch of a call.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import jax.numpy as jnp

__all__ = ["LaunchTable", "DEFAULT_TABLE", "LEGACY_TILES", "SPARSE_TILES", "TILE_KERNELS", "UNIONS",
           "SCORE_CLASSES", "SCORE_LAUNCH_BASE", "SCORE_STATIC", "EVICT", "score_size_class", "score_keys_label",
           "score_launch", "pages_per_program"]

# Size classes of a scoring call, chosen at trace time from static shapes: the first entry whose bound
# is >= B * NP (logical pages of the page table; bound None = no limit). "tiny" (up to 1,024 pages, e.g.
# batch 8 x 16K): the serving sweep's small cells, whose tuned "small" launch (8 pages per program) left a
# few programs walking 8 pages each (1 x 4K: 4 programs); its entries leave ppp to fill the GPU. Batch
# 1 x 1M tokens (8192 pages) and batch 32 x 32K are "small", batch 32 x 128K (32768) and batch 32 x 1M
# (262144) "large" (the bound, 16384 pages = 2M tokens, lies between the two swept cases, 1 x 1M and
# 32 x 1M; it is not tuned).
SCORE_CLASSES = (("tiny", 1024), ("small", 16384), ("large", None))
# Launch of the scoring kernel under every ``LaunchTable.score`` entry. Keys: "ppp" pages per program
# (None = sized to fill the GPU), "unroll" pages per loop iteration, "num_warps", "num_stages", "f16"
# (fp8 keys: f16 product), "programs" (0 = one program per (request, chunk of ppp pages); N >= 1 = the
# persistent scorer: N programs, each walking one contiguous range of the flattened (request, page)
# work list), "evict" (L2 eviction policy of the key loads: "evict_normal" (a plain load),
# "evict_first" or "evict_last").
SCORE_LAUNCH_BASE = types.MappingProxyType({"ppp": None, "num_warps": 4, "num_stages": 3, "unroll": 1,
                                            "f16": False, "programs": 0, "evict": "evict_normal"})
EVICT = ("evict_normal", "evict_first", "evict_last")
SPARSE_TILES = ("shared", "per_row")
TILE_KERNELS = ("auto", "triton", "wgmma")
UNIONS = ("kernel", "xla")
SCORE_STATIC = ("ppp", "num_warps", "num_stages", "loop", "unroll", "f16", "programs", "evict")


def _frozen(x):
    """``x`` with every nested mapping copied into a read-only ``types.MappingProxyType``."""
    if isinstance(x, Mapping):
        return types.MappingProxyType({k: _frozen(v) for k, v in x.items()})
    return x


def _thawed(x):
    """``x`` with every nested mapping copied into a plain dict (JSON-ready)."""
    return {k: _thawed(v) for k, v in x.items()} if isinstance(x, Mapping) else x


def _hash_key(x):
    """A hashable key of ``x`` that equal nested mappings share (items sorted)."""
    return tuple(sorted((k, _hash_key(v)) for k, v in x.items())) if isinstance(x, Mapping) else x


@dataclasses.dataclass(frozen=True)
class LaunchTable:
    """Launch defaults of the GPU decode kernels, used where a call passes None (read-only: nested
    mappings are ``types.MappingProxyType``; build another table with ``dataclasses.replace``).

    loop: "dynamic" = data-dependent trip counts (pages past the end are never read), "static" = fixed
      trip counts with clamped, masked slots (the persistent scorer always uses dynamic trip counts).
    score: launch table of the page-scoring kernel, ``score[keys][size class]``, keys "fp8" for 1-byte
      index keys and "bf16" for the others (``score_keys_label``), size classes of ``SCORE_CLASSES``; an
      entry holds ``score_launch`` keys over ``SCORE_LAUNCH_BASE``; explicit launch kwargs override it
      key by key. The defaults are the per-case winners of bench/msa_decode.py --sweep-scores
      (``--score-family narrow``, scoring alone; the best geometric mean when several swept cases fall
      into one class; see BENCHMARKS.md, msa_decode).
    attn_warps, attn_stages: Triton launch of the split-KV attention kernel; attn_warps_wide: its warps
      when a tile holds more than 64 rows (the accumulator and logits of a 128-row tile need 8 warps'
      registers).
    tile_rows: most rows (query rows x heads of a kv group, padded to a power of two >= 16) of one
      attention tile; the Q rows of a request beyond it go to further row blocks, each reading the pages.
    sparse_tile: sparse (MSA) attention tiling: "shared" = the Q rows of a row block share one tile and
      walk the union of their selected pages (each page read once per request, kv group and row block;
      a row sees only its own pages), "per_row" = one tile per query row over its own pages.
    select_splits: slices per score row of the top-k selection (``gpu_select._select_rows``): 1 = one
      program per row (single stage), a power of two S > 1 = two-stage split top-k, "auto" = the
      largest power of two S with W / S >= 512 pages per slice and B * rows * S <= 4096 programs
      (``gpu_select._auto_select_splits``). 4 from bench/msa_decode.py --sweep-select (ids identical to
      S = 1 by construction; BENCHMARKS.md, msa_decode). Applies to score rows of at least
      ``gpu_select.SPLIT_MIN_WIDTH`` pages; narrower rows are ranked in one stage.
    sparse_pps: selected-page slots per program of sparse (MSA) attention (a power of two; 1 = one page
      per split). 4 from --sweep-sparse-pps at K = 16 (BENCHMARKS.md, msa_decode).
    tile_kernel: "triton" (the Pallas Triton kernel for every attention tile), "wgmma" (dense and shared
      sparse tiles of 64 or 128 rows with bf16 / f16 caches on the Hopper Mosaic GPU kernel,
      ``gpu_attention_wgmma``; the other tiles on the Triton kernel) or "auto" (the default: "wgmma" on a
      visible GPU of compute capability 9.x, compiled; "triton" otherwise, interpreted and without a GPU
      too; BENCHMARKS.md, MSA decode: the wgmma tiles won at Q = 8); wgmma_stages: its K/V ring slots;
      wgmma_pingpong: its two compute warpgroups of a 128-row tile take turns on the tensor cores.
    union: how shared sparse tiles get the union of their rows' pages: "kernel" (one Triton launch,
      ``gpu_union.union_pages_gpu``, where it serves the row block and page table: pairwise at Q = 1, a page
      bitmap for wider blocks over small page tables; the XLA form otherwise) or "xla"
      (``common.union_pages``: about seven small XLA fusions, each a launch of its own).
    """

    loop: str = "dynamic"
    score: Mapping[str, Mapping[str, Mapping[str, object]]] = dataclasses.field(default_factory=dict)
    attn_warps: int = 4
    attn_stages: int = 2
    attn_warps_wide: int = 8
    tile_rows: int = 128
    sparse_tile: str = "shared"
    select_splits: int | str = 4
    sparse_pps: int = 4
    tile_kernel: str = "auto"
    wgmma_stages: int = 2
    wgmma_pingpong: bool = True
    union: str = "kernel"

    def __post_init__(self):
        object.__setattr__(self, "score", _frozen(self.score))
        if self.tile_kernel not in TILE_KERNELS:
            raise ValueError(f"tile_kernel must be one of {TILE_KERNELS}, got {self.tile_kernel!r}")
        w = self.wgmma_stages
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"wgmma_stages must be an int >= 1, got {w!r}")
        if not isinstance(self.wgmma_pingpong, bool):
            raise ValueError(f"wgmma_pingpong must be a bool, got {self.wgmma_pingpong!r}")
        if self.union not in UNIONS:
            raise ValueError(f"union must be one of {UNIONS}, got {self.union!r}")
        if self.sparse_tile not in SPARSE_TILES:
            raise ValueError(f"sparse_tile must be one of {SPARSE_TILES}, got {self.sparse_tile!r}")
        t = self.tile_rows
        if isinstance(t, bool) or not isinstance(t, int) or t < 16 or t & (t - 1):
            raise ValueError(f"tile_rows must be a power of two >= 16, got {t!r}")

    def __hash__(self):
        return hash(_hash_key(self.to_dict()))

    def to_dict(self) -> dict:
        """The table as plain nested dicts (JSON-ready; the keys of the fields)."""
        return {f.name: _thawed(getattr(self, f.name)) for f in dataclasses.fields(self)}


DEFAULT_TABLE = LaunchTable(
    loop="dynamic",
    score={"bf16": {"tiny": {"num_warps": 2, "num_stages": 4},
                    "small": {"num_warps": 2, "num_stages": 4, "ppp": 8},
                    "large": {"num_warps": 1, "num_stages": 2, "ppp": 8}},
           "fp8": {"tiny": {"num_warps": 1, "num_stages": 3, "f16": True},
                   "small": {"num_warps": 1, "num_stages": 3, "ppp": 8, "f16": True},
                   "large": {"num_warps": 1, "num_stages": 3, "ppp": 4, "f16": True}}},
    attn_warps=4, attn_stages=2, attn_warps_wide=8, tile_rows=128, sparse_tile="shared", select_splits=4,
    sparse_pps=4, tile_kernel="auto")

#: The attention tiling before shared tiles (for comparison in bench/msa_decode.py --serving): at most 64
#: rows per tile (Q = 8 rows of 16 heads in two row blocks), one tile per query row in sparse mode.
LEGACY_TILES = dataclasses.replace(DEFAULT_TABLE, tile_rows=64, sparse_tile="per_row")


def _table(table: LaunchTable | None) -> LaunchTable:
    return DEFAULT_TABLE if table is None else table


def score_size_class(total_pages: int | None) -> str:
    """Size class of a scoring call: the first entry of ``SCORE_CLASSES`` whose bound is >= ``total_pages``
    = B * NP (the page table's logical pages); None = the first class."""
    if total_pages is None:
        return SCORE_CLASSES[0][0]
    for name, bound in SCORE_CLASSES:
        if bound is None or total_pages <= bound:
            return name
    return SCORE_CLASSES[-1][0]


def score_keys_label(ki_dtype) -> str:
    """Key of ``LaunchTable.score`` for an index-key dtype: "fp8" for 1-byte keys, else "bf16"."""
    return "fp8" if jnp.dtype(ki_dtype).itemsize == 1 else "bf16"


def score_launch(ki_dtype, ppp=None, num_warps=None, num_stages=None, loop=None, unroll=None, f16=None, *,
                 total_pages=None, size_class=None, programs=None, evict=None, table: LaunchTable | None = None):
    """Launch parameters of the scoring kernel (``SCORE_STATIC`` keys, a new dict): ``SCORE_LAUNCH_BASE``
    and ``table.loop``, overridden by the ``table.score`` entry of the key dtype and of ``size_class``
    (None = the class of ``total_pages``, ``score_size_class``), overridden by the explicit values (not
    None). ``table``: None = ``DEFAULT_TABLE``. Raises ValueError for an unknown size class."""
    table = _table(table)
    if size_class is None:
        size_class = score_size_class(total_pages)
    elif size_class not in dict(SCORE_CLASSES):
        raise ValueError(f"unknown size class {size_class!r}; known: {[n for n, _ in SCORE_CLASSES]}")
    cfg = dict(SCORE_LAUNCH_BASE, loop=table.loop)
    cfg.update(table.score[score_keys_label(ki_dtype)].get(size_class, {}))
    given = {"ppp": ppp, "num_warps": num_warps, "num_stages": num_stages, "loop": loop, "unroll": unroll,
             "f16": f16, "programs": programs, "evict": evict}
    cfg.update({k: v for k, v in given.items() if v is not None})
    return cfg


def pages_per_program(total_pages: int, target_programs: int, cap: int) -> int:
    """Power of two near ``total_pages / target_programs`` in ``[1, cap]`` (enough programs to fill the GPU)."""
    want = max(1.0, total_pages / target_programs)
    p = 1
    while p * 2 <= cap and p * 2 <= want * 1.5:
        p *= 2
    return p
