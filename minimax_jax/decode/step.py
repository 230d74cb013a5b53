"""One model step over paged caches: write the new tokens' K/V (and index keys), attend, MLP, logits.

Used for both chunked prefill and decode: the new tokens of row ``b`` sit at ``positions[b, :]``
(``-1`` = padding, never written) and are a causal suffix of that row's cached keys, so a prefill
chunk over a cached prefix and a decode step with ``Q`` speculative rows are the same computation.

Two attention paths (same math, MSA_SPEC.md sections 3 and 5):
- ``"gather"`` (prefill chunks): the row's pages are gathered into a contiguous ``[B, S]`` view and
  the full-sequence ops run with queries as a suffix of keys: ``minimax_jax.ops.msa`` selection +
  sparse attention for MSA layers; for dense / sliding layers ``minimax_jax.ops.prefill``
  (the op ``"prefill_attention"``: the GPU suffix-attention kernel or the XLA attention reference).
  ``S = page_table.shape[1] * page_size``: the caller may pass only the leading columns of the
  page table that cover every valid position (``DecodeEngine`` buckets them to a power of two of
  the filled length when the XLA ops run, whose cost grows with S; the kernels walk only the keys
  at positions ``<=`` their queries', so their cost follows the filled length at any S).
- ``"paged"`` (decode, ``Q <= 16`` rows): ``minimax_jax.ops.paged`` reads the pages directly
  (MSA layers: page scoring over the index-key pages, top-k + local page, split-KV attention).

Inside ``sharding.use_mesh``, each layer's cache write and attention run per device
(``minimax_jax.decode.mesh_attention``): kv heads over the tensor axes, and on the "gather" path a
chunk's tokens over the sequence axes (context parallelism).

Layer math is the model's own (``minimax_jax.model.transformer``: ``project_qkv``,
``project_index``, ``mlp_block``, ``embed``, ``unembed``), so the step equals ``forward``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.decode import mesh_attention
from minimax_jax.decode.cache import CacheSpec, gather_pages, write_layer
from minimax_jax.model.layers import rms_norm, rope_frequencies
from minimax_jax.model.params import layer_params, layer_segments, layers_layout
from minimax_jax.model.transformer import embed, mlp_block, project_index, project_qkv, unembed
from minimax_jax.ops import context_parallel
from minimax_jax.ops import msa as msa_ops
from minimax_jax.ops import paged, registry
from minimax_jax.ops.prefill import prefill_attention

__all__ = ["model_step", "greedy_steps", "PATHS", "PREFILL_IMPLEMENTATIONS", "LAYERS_REPORT"]

#: ``registry.implementation_report()`` key: how the step read the layer weights (``model.params.split_layers``).
LAYERS_REPORT = "decode.layers"
_LAYOUT_NOTES = {
    "split": "split (each layer's weights read in place)",
    "stacked": "stacked (each step copies every layer's weights out of the stack; model.split_layers avoids it)",
    "mixed": "mixed (the stacked segments' weights are copied out of their stacks in each step)",
}

PATHS = ("gather", "paged")
#: ``implementation`` values of the "gather" path: the names of the MSA ops and of ``prefill_attention``
#: (registry order; a name one of them lacks raises there for the layers it serves).
PREFILL_IMPLEMENTATIONS = tuple(dict.fromkeys((*registry.implementation_names("msa_attention"),
                                               *registry.implementation_names("prefill_attention"))))


def _norm(x, p, cfg):
    return rms_norm(x, p["scale"], eps=cfg.rms_norm_eps, kind=cfg.norm_kind)


def _attend_gather(cfg, spec, c, q, qi, page_table, positions, layer_type, impl):
    b, t = positions.shape
    k, v, ki = gather_pages(c, page_table, q.dtype)
    if layer_type == "msa":
        s = k.shape[1]
        q_seg = jnp.where(positions >= 0, 0, 1).astype(jnp.int32)      # padding rows see nothing
        kw = dict(q_positions=jnp.maximum(positions, 0),
                  kv_positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), q_segment_ids=q_seg,
                  kv_segment_ids=jnp.zeros((b, s), jnp.int32))
        ids = msa_ops.msa_select_blocks(qi, ki, block_size=spec.page_size, topk=cfg.index_topk,
                                        init_blocks=cfg.index_init_blocks, local_blocks=cfg.index_local_blocks,
                                        implementation=impl, **kw)
        o, _ = msa_ops.msa_attention(q, k, v, ids, block_size=spec.page_size, implementation=impl, **kw)
        return o
    window = cfg.sliding_window if layer_type == "sliding" else None
    return prefill_attention(q, k, v, positions, sliding_window=window, implementation=impl)


def _attend_paged(cfg, c, q, qi, page_table, positions, layer_type, impl):
    kw = dict(k_scale=c.get("k_scale"), v_scale=c.get("v_scale"), implementation=impl)
    if layer_type == "msa":
        o, _, _ = paged.msa_decode(q, qi, c["k"], c["v"], c["ki"], page_table, positions, ki_scale=c.get("ki_scale"),
                                   topk=cfg.index_topk, init_blocks=cfg.index_init_blocks,
                                   local_blocks=cfg.index_local_blocks, **kw)
        return o
    window = cfg.sliding_window if layer_type == "sliding" else None
    o, _ = paged.paged_attention(q, c["k"], c["v"], page_table, positions, sliding_window=window, **kw)
    return o


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "path", "implementation", "return_hidden"),
                   donate_argnames=("cache",))
def model_step(params, cache, tokens, positions, page_table, logit_rows=None, *, cfg: ModelConfig,
               spec: CacheSpec, path: str = "paged", implementation: str = "auto", return_hidden: bool = False):
    """Run the model on new tokens against the paged caches.

    Args:
      params: model params tree (docs/ARCHITECTURE.md).
        Decoder layers in either layout (``minimax_jax.model.params``); split ones (``split_layers``, what
        ``minimax_jax.infer.load_model`` returns) are read in place, stacked ones copied out of their stacks in
        every step (recorded under ``LAYERS_REPORT``).
      cache: list of layer caches (``minimax_jax.decode.cache``); donated and returned updated.
      tokens: ``[B, T]`` int32; positions: ``[B, T]`` int32 absolute positions, ``-1`` = padding.
        Within a row, valid positions must be the consecutive suffix ``len .. len + n - 1`` of the
        cached keys (every earlier position already written).
      page_table: ``[B, n]`` int32 physical page ids (0 = null page for unused entries), ``n <=
        pages_per_seq``; every page a valid position touches must be allocated and lie in the first
        ``n`` columns (``n * page_size > `` every valid position; not checked: positions are traced).
        The "paged" path takes the full ``[B, pages_per_seq]`` table.
      logit_rows: optional ``[B, K]`` int32 indices into the ``T`` axis: the final norm and the
        unembedding run only on those rows and the logits are ``[B, K, V]`` (prefill needs only the
        last prompt position); None = every row.
      cfg, spec: static config and cache spec. path: ``"gather"`` | ``"paged"`` (module docstring).
      implementation: ``"paged"``: the decode ops' (``minimax_jax.ops.paged``); ``"gather"``: one of
        ``PREFILL_IMPLEMENTATIONS``, passed to the MSA ops and, for dense / sliding layers, to
        ``minimax_jax.ops.prefill.prefill_attention``.
      return_hidden: also return the pre-final-norm hidden state (the MTP modules' input, as
        ``forward(..., return_hidden=True)``).
    Returns: ``(logits [B, T, V] float32, cache)``, or ``(logits, hidden [B, T, H], cache)`` with
      ``return_hidden`` (``[B, K, V]`` logits with ``logit_rows``; hidden always covers all ``T``
      rows); rows of padding tokens are meaningless.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    positions = positions.astype(jnp.int32)
    b, t = tokens.shape
    # On a mesh (mesh_attention): kv heads over the tensor axes, a prefill chunk's tokens over the sequence axes.
    mp = mesh_attention.plan(cfg, b, t, path)
    order = mesh_attention.order(mp)
    if order is not None:
        tokens, positions = tokens[:, order], positions[:, order]
    cos, sin = rope_frequencies(jnp.maximum(positions, 0), cfg.rotary_dim, cfg.rope_theta)
    x = mesh_attention.constrain(mp, embed(params, cfg, tokens))
    with context_parallel.token_order(order):
        x, cache = _layers(params, cfg, spec, cache, x, cos, sin, page_table, positions, mp, path, implementation)
    rows = None if logit_rows is None else logit_rows.astype(jnp.int32)
    if order is not None:
        inv = np.argsort(order).astype(np.int32)            # natural position i sits at slot inv[i]
        if rows is not None and not return_hidden:
            rows = jnp.asarray(inv)[rows]                   # read the rows where they sit (no full un-permute)
        else:
            x = x[:, inv]                                   # natural order for the logits and hidden states
    xl = x if rows is None else jnp.take_along_axis(x, rows[..., None], axis=1)
    logits = unembed(params, cfg, _norm(xl, params["final_norm"], cfg))
    if return_hidden:
        return logits, x, cache
    return logits, cache


def _layers(params, cfg, spec, cache, x, cos, sin, page_table, positions, mp, path, implementation):
    """The decoder layers of ``model_step``: ``(x, cache)`` after them."""
    b, t, _ = x.shape
    cache = list(cache)
    registry.record_implementation(LAYERS_REPORT, _LAYOUT_NOTES[layers_layout(params)])
    for seg, sp in zip(layer_segments(cfg), params["segments"]):
        for j in range(seg.length):
            li = seg.start + j
            lp = layer_params(sp, j)       # split layers are read in place; a stacked one is copied out
            h = _norm(x, lp["input_norm"], cfg)
            q, k, v = project_qkv(lp, h, cfg, cos, sin)
            qi = ki = None
            if seg.layer_type == "msa":
                qi, ki = project_index(lp, h, cfg, cos, sin)
            if mp is not None:
                kw = dict(layer_type=seg.layer_type, impl=implementation)
                attend = (functools.partial(_attend_gather, cfg, spec, **kw) if path == "gather"
                          else functools.partial(_attend_paged, cfg, **kw))
                o, cache[li] = mesh_attention.write_and_attend(mp, attend, cache[li], spec, q, k, v, qi, ki,
                                                               page_table, positions, path)
            else:
                cache[li] = write_layer(cache[li], k, v, ki, page_table, positions, spec)
                if path == "gather":
                    o = _attend_gather(cfg, spec, cache[li], q, qi, page_table, positions, seg.layer_type,
                                       implementation)
                else:
                    o = _attend_paged(cfg, cache[li], q, qi, page_table, positions, seg.layer_type,
                                      implementation)
            x = x + o.reshape(b, t, cfg.q_dim) @ lp["attn"]["o_proj"].astype(x.dtype)
            m, _ = mlp_block(lp, _norm(x, lp["post_attn_norm"], cfg), cfg, seg.mlp_type)
            x = x + m
            x = mesh_attention.constrain(mp, x)
    return x, cache


@functools.partial(jax.jit, static_argnames=("steps", "cfg", "spec", "implementation"), donate_argnames=("cache",))
def greedy_steps(params, cache, tokens, positions, page_table, *, steps: int, cfg: ModelConfig, spec: CacheSpec,
                 implementation: str = "auto"):
    """``steps`` greedy decode steps in one compiled loop (no host round trip between steps).

    Step ``i`` runs ``model_step`` ("paged" path) on each row's current token, then feeds back the
    argmax of its logits (lowest id on ties, as ``minimax_jax.sampling.greedy``) at the next position.

    Args:
      params, cache, page_table, cfg, spec, implementation: as ``model_step``; every page the ``steps``
        new positions touch must already be allocated.
      tokens: ``[B, Q]`` int32: column 0 holds each row's next input token; columns ``1..Q-1`` are padding
        (kept so that the step has the shapes of a ``Q``-row decode step, see ``DecodeEngine.query_rows``).
      positions: ``[B, Q]`` int32: column 0 the position of that token (``-1`` = idle row), the rest ``-1``.
      steps: static number of steps (>= 1).
    Returns: ``(chosen [B, steps] int32, cache)``: the token chosen after each step; step ``i``'s input
      token is written at ``positions[:, 0] + i``, so the cache then holds the input token and
      ``chosen[:, :steps - 1]``. Idle rows' entries are meaningless.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    pad_tok = jnp.zeros_like(tokens[:, 1:])

    def body(carry, _):
        cache, tok, pos = carry
        logits, cache = model_step(params, cache, tok, pos, page_table, cfg=cfg, spec=spec, path="paged",
                                   implementation=implementation)
        nxt = jnp.argmax(logits[:, 0].astype(jnp.float32), axis=-1).astype(jnp.int32)
        pos = pos.at[:, 0].set(jnp.where(pos[:, 0] >= 0, pos[:, 0] + 1, -1))
        return (cache, jnp.concatenate([nxt[:, None], pad_tok], axis=1), pos), nxt

    (cache, _, _), chosen = jax.lax.scan(body, (cache, tokens.astype(jnp.int32), positions.astype(jnp.int32)),
                                         None, length=steps)
    return chosen.T, cache

