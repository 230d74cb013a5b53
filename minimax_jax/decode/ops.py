"""Decode-time attention ops over paged caches, with an ``implementation=`` choice.

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
- ``msa_decode``: the two above composed.

Implementations: ``"xla"`` (reference, gathers pages; every platform), ``"pallas_gpu"`` (Triton
lowering), ``"pallas_tpu"`` (Mosaic, page tables via scalar prefetch), ``"pallas_interpret"`` (the TPU
kernels in interpret mode, CPU tests), ``"auto"`` (the Pallas kernel of the default backend on GPU /
TPU, ``"xla"`` on CPU). What ran is recorded with ``record_implementation`` under the op name. A
requested kernel that cannot serve the call (e.g. a sliding window) raises
``ImplementationUnavailable``; nothing falls back silently.
"""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp

from minimax_jax.decode.cache import dequantize
from minimax_jax.msa.reference import select_from_block_scores
from minimax_jax.ops.common import ImplementationUnavailable, default_backend, record_implementation

__all__ = ["paged_attention", "msa_decode_select", "msa_decode", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "pallas_gpu", "pallas_tpu", "pallas_interpret")
_BACKEND = {"pallas_gpu": "gpu", "pallas_tpu": "tpu", "pallas_interpret": "interpret"}
_HIGHEST = jax.lax.Precision.HIGHEST


def _resolve(op: str, implementation: str, *, kernel_ok: str | None = None):
    """Concrete implementation name and kernel module (or None for xla); records the choice."""
    if implementation not in IMPLEMENTATIONS:
        raise ImplementationUnavailable(f"{op}: unknown implementation {implementation!r}; "
                                        f"expected one of {IMPLEMENTATIONS}")
    impl = implementation
    if impl == "auto":
        be = default_backend()
        impl = f"pallas_{be}" if be in ("gpu", "tpu") and kernel_ok is None else "xla"
    api = None
    if impl != "xla":
        if kernel_ok is not None:
            raise ImplementationUnavailable(f"{op}: implementation {impl!r} cannot serve this call: {kernel_ok}")
        try:
            api = importlib.import_module("pallas_kernels.decode.api")
        except ImportError as e:
            raise ImplementationUnavailable(f"{op}: {impl!r} needs pallas_kernels.decode.api ({e})") from e
    record_implementation(op, impl)
    return impl, api


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


# ----------------------------------------------------------------------------- references

def _gather_kv(pages, scale, page_table, dtype):
    """[G, P, page, D] -> [B, G, NP*page, D] in ``dtype`` (logical order)."""
    x = pages[:, page_table]                                 # [G, B, NP, page, D]
    s = None if scale is None else scale[:, page_table]
    x = dequantize(x, s, dtype)
    g, b, n, p, d = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, g, n * p, d)


def _xla_attention(q, k_pages, v_pages, page_table, q_pos, k_scale, v_scale, block_ids, window):
    b, nq, h, d = q.shape
    g, _, p, _ = k_pages.shape
    k = _gather_kv(k_pages, k_scale, page_table, jnp.float32)
    v = _gather_kv(v_pages, v_scale, page_table, jnp.float32)
    s_len = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, nq, g, h // g, d)
    logits = jnp.einsum("bqgjd,bgsd->bgqjs", qg, k, precision=_HIGHEST) / math.sqrt(d)
    kpos = jnp.arange(s_len, dtype=jnp.int32)
    qp = q_pos[:, None, :, None, None]
    vis = (kpos <= qp) & (qp >= 0)
    if window is not None:
        vis &= qp - kpos < window
    if block_ids is not None:                                # [B, G, Q, K] logical pages
        sel = jnp.any(block_ids[..., None] == (kpos // p)[None, None, None, None, :], axis=3)
        vis &= sel[:, :, :, None, :]
    logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(logits - m_safe), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bgqjs,bgsd->bqgjd", e / jnp.where(den > 0, den, 1.0), v, precision=_HIGHEST)
    lse = jnp.where(den[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(den[..., 0] > 0, den[..., 0], 1.0)),
                    -jnp.inf)                                # [B, G, Q, J]
    return o.reshape(b, nq, h, d).astype(q.dtype), jnp.moveaxis(lse, 2, 1).reshape(b, nq, h)


def _xla_page_scores(qi, ki_pages, ki_scale, page_table):
    """Block scores of every logical page: ``[B, Hi, Q, NP]`` f32 (max over the page's tokens)."""
    ki = dequantize(ki_pages[page_table], None if ki_scale is None else ki_scale[page_table], jnp.float32)
    s = jnp.einsum("bqhd,bnpd->bhqnp", qi.astype(jnp.float32), ki, precision=_HIGHEST)
    return jnp.max(s, axis=-1) / math.sqrt(qi.shape[-1])


def select_from_page_scores(scores, q_positions, page_size, *, topk, init_blocks=0, local_blocks=1):
    """Selection from raw page scores ``[B, Hi, Q, NP]``: ranks only complete pages ``< local``.

    Pages at or after the local page are made ineligible; the local page itself is forced
    (MSA_SPEC.md sections 2 and 5). Rows with ``pos < 0`` select nothing. Returns ``[B, Hi, Q, K]``
    int32 logical page ids in reference order, ``-1`` padded.
    """
    n = scores.shape[-1]
    local = jnp.where(q_positions >= 0, q_positions // page_size, -1)            # [B, Q]
    ids = jnp.arange(n, dtype=jnp.int32)
    loc = local[:, None, :, None]
    s = jnp.where(ids < loc, scores, jnp.where(ids == loc, 0.0, -jnp.inf))
    return select_from_block_scores(s, local, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)


# ----------------------------------------------------------------------------- public ops

def paged_attention(q, k_pages, v_pages, page_table, q_positions, *, k_scale=None, v_scale=None,
                    block_ids=None, sliding_window=None, implementation="auto", pages_per_split=None):
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
    Returns: ``(o [B, Q, H, D] q.dtype, lse [B, Q, H] float32)`` (natural log of the softmax
      denominator over the scaled logits; ``-inf`` for rows that see no key).
    Raises: ValueError for bad shapes; ImplementationUnavailable.
    """
    op = "paged_attention"
    _check(op, q, k_pages, page_table, q_positions)
    q_positions = q_positions.astype(jnp.int32)
    page_table = page_table.astype(jnp.int32)
    if block_ids is not None and block_ids.shape[:3] != (q.shape[0], k_pages.shape[0], q.shape[1]):
        raise ValueError(f"{op}: block_ids must be [B, G, Q, K], got {block_ids.shape}")
    impl, api = _resolve(op, implementation,
                         kernel_ok=None if sliding_window is None else "sliding windows are xla-only")
    if api is None:
        return _xla_attention(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale,
                              None if block_ids is None else block_ids.astype(jnp.int32), sliding_window)
    return api.paged_attention(q, k_pages, v_pages, page_table, q_positions, k_scale=k_scale, v_scale=v_scale,
                               block_ids=block_ids, backend=_BACKEND[impl], pages_per_split=pages_per_split)


def msa_decode_select(qi, ki_pages, page_table, q_positions, *, ki_scale=None, topk, init_blocks=0,
                      local_blocks=1, implementation="auto"):
    """Per-row, per-group page selection for MSA decode (MSA_SPEC.md section 5).

    Args:
      qi: ``[B, Q, Hi, Di]`` index queries (one per kv group).
      ki_pages: ``[P, page, Di]`` index keys; ki_scale: ``[P, page]`` f32 for fp8, else None.
      page_table: ``[B, NP]`` int32; q_positions: ``[B, Q]`` int32 (-1 = padding row).
      topk, init_blocks, local_blocks: as ``minimax_jax.ops.msa.msa_select_blocks``.
    Returns: ``[B, Hi, Q, K]`` int32 logical page ids; reference order for "xla", any order for
      kernels (compare sets); ``-1`` padded; the local page always present for valid rows.
    Raises: ValueError; ImplementationUnavailable.
    """
    op = "msa_decode_select"
    if qi.ndim != 4 or ki_pages.ndim != 3 or ki_pages.shape[-1] != qi.shape[-1]:
        raise ValueError(f"{op}: qi must be [B,Q,Hi,Di] and ki_pages [P,page,Di]; got {qi.shape}, {ki_pages.shape}")
    if q_positions.shape != qi.shape[:2] or page_table.shape[0] != qi.shape[0]:
        raise ValueError(f"{op}: q_positions {q_positions.shape} / page_table {page_table.shape} "
                         f"do not match qi {qi.shape}")
    impl, api = _resolve(op, implementation)
    q_positions = q_positions.astype(jnp.int32)
    page_table = page_table.astype(jnp.int32)
    if api is not None:
        return api.select_pages(qi, ki_pages, page_table, q_positions, ki_scale=ki_scale, topk=topk,
                                init_blocks=init_blocks, local_blocks=local_blocks, backend=_BACKEND[impl])
    scores = _xla_page_scores(qi, ki_pages, ki_scale, page_table)
    return select_from_page_scores(scores, q_positions, ki_pages.shape[1], topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks)


def msa_decode(q, qi, k_pages, v_pages, ki_pages, page_table, q_positions, *, k_scale=None, v_scale=None,
               ki_scale=None, topk, init_blocks=0, local_blocks=1, implementation="auto"):
    """``msa_decode_select`` then ``paged_attention(block_ids=...)``. Returns ``(o, lse, block_ids)``."""
    ids = msa_decode_select(qi, ki_pages, page_table, q_positions, ki_scale=ki_scale, topk=topk,
                            init_blocks=init_blocks, local_blocks=local_blocks, implementation=implementation)
    o, lse = paged_attention(q, k_pages, v_pages, page_table, q_positions, k_scale=k_scale, v_scale=v_scale,
                             block_ids=ids, implementation=implementation)
    return o, lse, ids
