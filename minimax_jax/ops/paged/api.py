"""Decode-time attention ops over paged caches: argument validation (once, here) and the registry entries.

Math: MSA_SPEC.md section 5. A decode step carries ``Q = 1..16`` query rows per request (the main
token and speculative draft tokens); row ``i`` of request ``b`` sits at position
``q_positions[b, i]`` (``-1`` = padding row: it selects nothing and returns ``o = 0``,
``lse = -inf``). Keys are the request's cached tokens: logical page ``n`` of ``page_table[b]``
holds positions ``[n*page, (n+1)*page)``; key ``j`` is visible to row ``i`` iff ``j <= pos_i``
(and ``pos_i - j < window`` for sliding layers).

Ops (one per concern):
- ``paged_attention``: GQA attention of the rows over their visible cached keys, either all of
  them (dense layers) or only the pages ``block_ids[b, g, i, :]`` (MSA layers; logical page ids,
  ``-1`` = empty slot). Returns ``(o, lse)``.
- ``msa_decode_select``: per row and kv group, score the COMPLETE pages ``< local = pos_i // page``
  with the index query (block score = max over the page's tokens of ``<qi, ki> / sqrt(Di)``), keep
  the best ``topk - 1`` (ties to the lower id) and force the local page. Returns logical page ids.
- ``msa_decode``: the two above composed; when every valid row's local page is ``< topk`` (the
  selection would keep every page ``0..local``) and that is known at trace time it skips the scoring
  and runs the dense ``paged_attention`` (same result; recorded under ``"msa_decode.path"``); in a
  traced ragged batch the GPU kernels skip scoring per short row (see ``msa_decode``).

Implementations (``minimax_jax.ops.registry``; what ran is recorded under the op's name):
``"xla"`` (reference, gathers pages; every platform; ``xla.py``), ``"pallas_gpu"`` (Triton),
``"pallas_tpu"`` (Mosaic, page tables via scalar prefetch), ``"pallas_gpu_interpret"`` /
``"pallas_tpu_interpret"`` (those kernels in Pallas interpret mode, CPU tests; ``pallas.py``),
``"auto"`` (the Pallas kernel of the default backend on GPU / TPU when it serves the call, else
``"xla"`` with the reason under ``"<op>.auto_reason"``; ``"xla"`` on CPU). A requested kernel that
cannot serve the call (e.g. a sliding window) raises ``ImplementationUnavailable``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax.ops import registry
from minimax_jax.ops.paged import pallas as _pallas
from minimax_jax.ops.paged import xla as _xla
from minimax_jax.ops.registry import Implementation, record_implementation

__all__ = ["paged_attention", "msa_decode_select", "msa_decode", "IMPLEMENTATIONS"]


def _check(op, q, k_pages, page_table, q_positions):
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(f"{op}: q must be [B,Q,H,D] and k_pages [G,P,page,D]; got {q.shape}, {k_pages.shape}")
    b, nq, h, d = q.shape
    g = k_pages.shape[0]
    if k_pages.shape[3] != d or h % g:
        raise ValueError(f"{op}: q {q.shape} does not fit k_pages {k_pages.shape} (D equal, H % G == 0)")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"{op}: page_table must be [B={b}, NP], got {page_table.shape}")
    if q_positions.shape != (b, nq):
        raise ValueError(f"{op}: q_positions must be [B={b}, Q={nq}], got {q_positions.shape}")


def _check_select(op, qi, ki_pages, page_table, q_positions):
    if qi.ndim != 4 or ki_pages.ndim != 3 or ki_pages.shape[-1] != qi.shape[-1]:
        raise ValueError(f"{op}: qi must be [B,Q,Hi,Di] and ki_pages [P,page,Di]; got {qi.shape}, {ki_pages.shape}")
    if q_positions.shape != qi.shape[:2] or page_table.shape[0] != qi.shape[0]:
        raise ValueError(f"{op}: q_positions {q_positions.shape} / page_table {page_table.shape} "
                         f"do not match qi {qi.shape}")


def paged_attention(q, k_pages, v_pages, page_table, q_positions, *, k_scale=None, v_scale=None,
                    block_ids=None, sliding_window=None, implementation="auto", pages_per_split=None,
                    launch_table=None):
    """GQA decode attention over a paged cache (dense, or MSA-sparse with ``block_ids``).

    Args:
      q: ``[B, Q, H, D]`` float queries (RoPE applied); head ``h`` uses kv head ``h // (H/G)``.
      k_pages, v_pages: ``[G, P, page, D]`` (float32 / bfloat16 / float8_e4m3fn).
      page_table: ``[B, NP]`` int32 physical page of each logical page.
      q_positions: ``[B, Q]`` int32 row positions (-1 = padding row).
      k_scale, v_scale: ``[G, P, page]`` float32 per-token scales for fp8 caches, else None.
      block_ids: None (dense causal) or ``[B, G, Q, K]`` int32 logical page ids (-1 = empty).
      sliding_window: None or a window in tokens (xla only).
      implementation: see the module docstring.
      pages_per_split: pages per split-KV program of the dense GPU kernel (None = its default).
      launch_table: launch defaults of the GPU kernels (``pallas_kernels.decode.gpu_config.LaunchTable``;
        None = its ``DEFAULT_TABLE``); other implementations ignore it.
    Returns: ``(o [B, Q, H, D] q.dtype, lse [B, Q, H] float32)`` (natural log of the softmax
      denominator over the scaled logits; ``-inf`` for rows that see no key).
    Raises: ValueError for bad shapes; ImplementationUnavailable.
    """
    op = "paged_attention"
    _check(op, q, k_pages, page_table, q_positions)
    if block_ids is not None:
        if block_ids.shape[:3] != (q.shape[0], k_pages.shape[0], q.shape[1]):
            raise ValueError(f"{op}: block_ids must be [B, G, Q, K], got {block_ids.shape}")
        block_ids = block_ids.astype(jnp.int32)
    return registry.dispatch(op, implementation, q, k_pages, v_pages, page_table.astype(jnp.int32),
                             q_positions.astype(jnp.int32), k_scale=k_scale, v_scale=v_scale, block_ids=block_ids,
                             sliding_window=sliding_window, pages_per_split=pages_per_split,
                             launch_table=launch_table)


def msa_decode_select(qi, ki_pages, page_table, q_positions, *, ki_scale=None, topk, init_blocks=0,
                      local_blocks=1, implementation="auto", launch_table=None):
    """Per-row, per-group page selection for MSA decode (MSA_SPEC.md section 5).

    Args:
      qi: ``[B, Q, Hi, Di]`` index queries (one per kv group).
      ki_pages: ``[P, page, Di]`` index keys; ki_scale: ``[P, page]`` f32 for fp8, else None.
      page_table: ``[B, NP]`` int32; q_positions: ``[B, Q]`` int32 (-1 = padding row).
      topk, init_blocks, local_blocks: as ``minimax_jax.ops.msa.msa_select_blocks``.
      launch_table: as ``paged_attention``.
    Returns: ``[B, Hi, Q, K]`` int32 logical page ids; reference order for "xla", any order for
      kernels (compare sets); ``-1`` padded; the local page always present for valid rows.
    Raises: ValueError; ImplementationUnavailable.
    """
    op = "msa_decode_select"
    _check_select(op, qi, ki_pages, page_table, q_positions)
    return registry.dispatch(op, implementation, qi, ki_pages, page_table.astype(jnp.int32),
                             q_positions.astype(jnp.int32), ki_scale=ki_scale, topk=topk, init_blocks=init_blocks,
                             local_blocks=local_blocks, launch_table=launch_table)


def msa_decode(q, qi, k_pages, v_pages, ki_pages, page_table, q_positions, *, k_scale=None, v_scale=None,
               ki_scale=None, topk, init_blocks=0, local_blocks=1, implementation="auto", launch_table=None,
               runtime_dense_check=False):
    """``msa_decode_select`` then ``paged_attention(block_ids=...)``. Returns ``(o, lse, block_ids)``.

    Arguments as those two ops (valid rows' positions inside the page table). A row with
    ``pos // page < topk`` selects every page ``0..local`` (MSA == dense, MSA_SPEC.md section 2, whatever
    ``init_blocks`` / ``local_blocks``). Paths (``"msa_decode.path"``):
    ``"dense"``: static ``NP <= topk``, or eager positions all short: no scoring, dense
    ``paged_attention``, ids ``0..local`` ascending (equal as sets).
    ``"sparse"`` (eager with a long row; traced positions by default): selection then sparse attention
    for the whole batch, one launch each. With the GPU kernels every short row is handled per row
    inside those launches: its ids are ``0..local`` with no score computed or ranked, a request whose
    rows all are short is not scored (``"msa_decode_select.short_rows": "unscored"``), scoring reads
    each request's own pages only, and the shared-tile sparse attention reads each selected page once
    per (request, kv group), so a short request costs what dense attention costs. The XLA and TPU
    selections score every request (``"scored"`` for TPU; same ids as sets).
    ``"cond"`` (traced positions with ``runtime_dense_check``): ``jax.lax.cond`` picks dense when every
    row is short, else the sparse path above (opt-in: a GPU conditional may cost a host round trip per
    layer and step, unmeasured).
    Raises: ValueError (shapes, as the two ops); ImplementationUnavailable.
    """
    op = "msa_decode"
    _check(op, q, k_pages, page_table, q_positions)
    _check_select(op, qi, ki_pages, page_table, q_positions)
    if qi.shape[2] != k_pages.shape[0]:
        raise ValueError(f"{op}: qi has {qi.shape[2]} index heads, k_pages {k_pages.shape[0]} kv groups (equal)")
    page, n_pages = ki_pages.shape[1], page_table.shape[1]
    q_positions = jnp.asarray(q_positions, jnp.int32)
    kv = dict(k_scale=k_scale, v_scale=v_scale, implementation=implementation, launch_table=launch_table)

    def dense():
        o, lse = paged_attention(q, k_pages, v_pages, page_table, q_positions, **kv)
        return o.astype(q.dtype), lse.astype(jnp.float32), _all_pages(q_positions, page, n_pages, qi.shape[2], topk)

    def sparse():
        ids = msa_decode_select(qi, ki_pages, page_table, q_positions, ki_scale=ki_scale, topk=topk,
                                init_blocks=init_blocks, local_blocks=local_blocks, implementation=implementation,
                                launch_table=launch_table)
        o, lse = paged_attention(q, k_pages, v_pages, page_table, q_positions, block_ids=ids, **kv)
        return o.astype(q.dtype), lse.astype(jnp.float32), ids.astype(jnp.int32)

    short = jnp.all((q_positions < 0) | (q_positions // page < topk))
    if n_pages <= topk or not isinstance(short, jax.core.Tracer):
        path = "dense" if n_pages <= topk or bool(short) else "sparse"
        record_implementation(f"{op}.path", path)
        return dense() if path == "dense" else sparse()
    if not runtime_dense_check:
        record_implementation(f"{op}.path", "sparse")
        return sparse()
    record_implementation(f"{op}.path", "cond")
    return jax.lax.cond(short, dense, sparse)


def _all_pages(q_positions, page, n_pages, n_groups, topk):
    """``[B, G, Q, topk]`` int32: pages ``0..local`` (``< n_pages``) of each valid row ascending, ``-1`` after."""
    local = jnp.where(q_positions >= 0, q_positions // page, -1)[:, None, :, None]
    slot = jnp.arange(topk, dtype=jnp.int32)
    ids = jnp.where((slot <= local) & (slot < n_pages), slot, -1).astype(jnp.int32)
    b, nq = q_positions.shape
    return jnp.broadcast_to(ids, (b, n_groups, nq, topk))


def _kernel_then_xla(backend, *args, **kwargs):
    """``"auto"``: the backend's kernel when it serves the call, else the XLA reference."""
    return {"gpu": ("pallas_gpu", "xla"), "tpu": ("pallas_tpu", "xla")}.get(backend, ("xla",))


registry.register("paged_attention", [Implementation("xla", _xla.paged_attention), *_pallas.PAGED_ATTENTION],
                  auto=_kernel_then_xla)
registry.register("msa_decode_select", [Implementation("xla", _xla.msa_decode_select), *_pallas.DECODE_SELECT],
                  auto=_kernel_then_xla)

#: Every ``implementation=`` name of the paged decode ops (``"auto"`` first).
IMPLEMENTATIONS = registry.implementation_names("paged_attention")
