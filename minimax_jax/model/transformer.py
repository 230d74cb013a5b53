"""The decoder forward pass as pure functions of (params, config, inputs).

Layer (M2 and M3, MODEL_FACTS.md): ``h = x + o_proj(attn(input_norm(x)))``;
``y = h + mlp(post_attn_norm(h))``; then the final norm and an untied lm_head. Attention is GQA
with q/k RMSNorm (full width for M2, per head for M3) and partial NeoX RoPE; "msa" layers select
blocks with the index branch (MSA_SPEC.md) and attend only those; "sliding" layers use a window.
The MLP is a sigmoid-routed MoE (optionally with a shared expert) or a dense gated MLP.

Pieces used by the decode engine (``project_qkv``, ``project_index``, ``mlp_block``, ``embed``,
``unembed``) are public so the cache code reuses the same math.
"""

from __future__ import annotations

import dataclasses

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig, dtype_of
from minimax_jax.model.layers import apply_rope, dense_mlp, gated_activation, rms_norm, rope_frequencies
from minimax_jax.model.msa_block import msa_block
from minimax_jax.model.params import is_split, layer_segments, mtp_compute_kinds
from minimax_jax.ops import context_parallel
from minimax_jax.ops.attention import attention
from minimax_jax.ops.logits import logits_matmul
from minimax_jax.ops.moe import moe_experts, route
from minimax_jax.sharding import constrain

__all__ = ["ModelOutput", "forward", "mtp_forward", "project_qkv", "project_index", "attention_block",
           "mlp_block", "decoder_layer", "embed", "unembed", "lm_head_weight"]

INDEXER_KL_MODES = (None, "sparse", "dense")


class ModelOutput(NamedTuple):
    """logits ``[B,T,V]`` float32 (None with ``return_logits=False``); hidden ``[B,T,H]``
    (pre-final-norm, for MTP) or None; aux dict; head_input ``[B,T,H]`` (the final-normed hidden
    state the lm head reads) only with ``return_logits=False``."""

    logits: jax.Array | None
    hidden: jax.Array | None
    aux: dict[str, Any]
    head_input: jax.Array | None = None


def _norm(x, p, cfg):
    return rms_norm(x, p["scale"], eps=cfg.rms_norm_eps, kind=cfg.norm_kind)


def embed(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embedding lookup: ``[B,T]`` int32 -> ``[B,T,H]`` compute dtype."""
    return jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(dtype_of(cfg.dtype))


def lm_head_weight(params, cfg: ModelConfig) -> jax.Array:
    """The output projection ``[H, V]`` (param dtype): ``lm_head``, or the transposed embedding when tied."""
    return params["embed"]["embedding"].T if cfg.tie_word_embeddings else params["lm_head"]


def unembed(params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Final-normed hidden ``[...,H]`` -> logits ``[...,V]`` float32 (lm_head or tied embedding)."""
    return logits_matmul(h, lm_head_weight(params, cfg).astype(h.dtype))


def project_qkv(p: dict, x: jax.Array, cfg: ModelConfig, cos: jax.Array, sin: jax.Array):
    """Project the normed input to RoPE'd q ``[B,T,H,D]``, k ``[B,T,G,D]`` and v ``[B,T,G,D]``.

    q/k norm: "full" normalises the whole projected width before splitting heads (M2; under tensor
    parallelism its variance spans shards), "per_head" normalises each head (M3).
    """
    b, t, _ = x.shape
    a = p["attn"]
    q = x @ a["q_proj"].astype(x.dtype)
    k = x @ a["k_proj"].astype(x.dtype)
    v = x @ a["v_proj"].astype(x.dtype)
    if cfg.qk_norm == "full":
        q, k = _norm(q, a["q_norm"], cfg), _norm(k, a["k_norm"], cfg)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "per_head":
        q, k = _norm(q, a["q_norm"], cfg), _norm(k, a["k_norm"], cfg)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def project_index(p: dict, x: jax.Array, cfg: ModelConfig, cos: jax.Array, sin: jax.Array):
    """MSA index branch: qi ``[B,T,Hi,Di]``, ki ``[B,T,Di]`` (MSA_SPEC.md section 1).

    The input is ``stop_gradient``-ed so the LM loss never trains the index projections; index
    q/k get a per-head norm and (``index_rope``) the same partial RoPE as the main q/k.
    """
    b, t, _ = x.shape
    a = p["attn"]
    xs = jax.lax.stop_gradient(x)
    hi, di = cfg.index_num_heads, cfg.index_head_dim
    qi = (xs @ a["index_q_proj"].astype(x.dtype)).reshape(b, t, hi, di)
    ki = (xs @ a["index_k_proj"].astype(x.dtype)).reshape(b, t, 1, di)
    qi, ki = _norm(qi, a["index_q_norm"], cfg), _norm(ki, a["index_k_norm"], cfg)
    if cfg.index_rope:
        qi, ki = apply_rope(qi, cos, sin), apply_rope(ki, cos, sin)
    return qi, ki[:, :, 0]


def attention_block(p, x, cfg: ModelConfig, layer_type: str, positions, segment_ids, cos, sin,
                    indexer_kl: str | None, return_msa: bool = False, subtree_end=None, input_weight=None,
                    tree_keys=None):
    """Self-attention of one layer over its own tokens (``subtree_end``, ``input_weight``, ``tree_keys``:
    prefix-tree rows, see ``forward`` and ``minimax_jax.model.msa_block``).

    Returns ``(out [B,T,H], kl_sum, kl_count, msa)`` where ``msa`` is ``{}`` or, for MSA layers with
    ``return_msa``, ``{"block_ids": [B,Hi,T,K] int32, "lse": [B,T,H] f32}`` (main-branch LSE).
    """
    b, t, _ = x.shape
    q, k, v = project_qkv(p, x, cfg, cos, sin)
    q = constrain(q, ("batch", "length", "act_heads", None))
    k, v = constrain(k, ("batch", "length", "act_kv_heads", None)), constrain(v, ("batch", "length", "act_kv_heads", None))
    kl_sum = jnp.zeros((), jnp.float32)
    kl_cnt = jnp.zeros((), jnp.float32)
    extra: dict[str, jax.Array] = {}
    pos_kw = dict(q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids,
                  kv_segment_ids=segment_ids)
    tree_kw = {} if subtree_end is None else {"kv_subtree_end": subtree_end}
    # Context parallelism (a sequence-sharded mesh): local queries against all-gathered keys in shard_map.
    cp = _context_plan(cfg, (b, t), subtree_end, input_weight, tree_keys)
    tree_rows = subtree_end is not None or input_weight is not None or tree_keys is not None
    if layer_type == "msa":
        qi, ki = project_index(p, x, cfg, cos, sin)
        if cp is not None and tree_rows:
            o, kl_sum, kl_cnt, ids, lse = _msa_tree_rows_local(cp, q, k, v, qi, ki, cfg, positions, segment_ids,
                                                               indexer_kl, subtree_end, input_weight, tree_keys)
        elif cp is not None:
            o, kl_sum, kl_cnt, ids, lse = _msa_context_parallel(cp, q, k, v, qi, ki, cfg, positions, segment_ids,
                                                                indexer_kl)
        else:
            o, kl_sum, kl_cnt, ids, lse = msa_block(q, k, v, qi, ki, cfg, positions, segment_ids, indexer_kl,
                                                    subtree_end=subtree_end, input_weight=input_weight,
                                                    tree_keys=tree_keys)
        if return_msa and ids is not None:
            extra = {"block_ids": ids, "lse": lse}
    else:
        window = cfg.sliding_window if layer_type == "sliding" else None
        impl = cfg.sliding_attention_impl if window is not None else cfg.attention_impl
        if cp is not None and tree_rows:
            def local_tree(q, k, v, pos, seg, sub):
                return (attention(q, k, v, sliding_window=window, implementation=impl, q_positions=pos,
                                  kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                                  **({} if sub is None else {"kv_subtree_end": sub})),)
            (o,) = _tree_rows_run(cp, local_tree, [q, k, v, positions, segment_ids, subtree_end], ["bth."],
                                  name="attention")
        elif cp is not None:
            def local(q, qp, qs, k, v, kp, ks):
                return (attention(q, k, v, sliding_window=window, implementation=impl, q_positions=qp,
                                  kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks),)
            (o,) = context_parallel.run(cp, local, [(q, "bth."), (positions, "bt"), (segment_ids, "bt")],
                                        [(k, "bth."), (v, "bth."), (positions, "bt"), (segment_ids, "bt")],
                                        ["bth."], name="attention")
        else:
            o = attention(q, k, v, sliding_window=window, implementation=impl, **pos_kw, **tree_kw)
    out = o.reshape(b, t, cfg.q_dim) @ p["attn"]["o_proj"].astype(x.dtype)
    return out, kl_sum, kl_cnt, extra


def _msa_context_parallel(cp, q, k, v, qi, ki, cfg: ModelConfig, positions, segment_ids, indexer_kl):
    """``msa_block`` with context parallelism (``minimax_jax.ops.context_parallel``): same returns (rows
    without KL weights: ``attention_block`` sends prefix-tree rows, the only weighted ones, to GSPMD)."""
    sparse = indexer_kl != "dense"

    def local(q, qi, qp, qs, k, v, ki, kp, ks):
        o, kl_sum, kl_cnt, ids, lse = msa_block(q, k, v, qi, ki, cfg, qp, qs, indexer_kl, kv_positions=kp,
                                                kv_segment_ids=ks)
        return (o, ids, lse, kl_sum, kl_cnt) if sparse else (o, kl_sum, kl_cnt)

    res = context_parallel.run(cp, local, [(q, "bth."), (qi, "bth."), (positions, "bt"), (segment_ids, "bt")],
                               [(k, "bth."), (v, "bth."), (ki, "bt."), (positions, "bt"), (segment_ids, "bt")],
                               ["bth.", "bht.", "bth"] if sparse else ["bth."], num_sums=2, name="msa")
    return _msa_result(res, sparse)


def _msa_result(res, sparse: bool):
    """``msa_block``'s returns from a shard_map'ed local call's ``(o, ids, lse, kl_sum, kl_cnt)`` (sparse) or
    ``(o, kl_sum, kl_cnt)``."""
    if sparse:
        o, ids, lse, kl_sum, kl_cnt = res
        return o, kl_sum, kl_cnt, ids, lse
    o, kl_sum, kl_cnt = res
    return o, kl_sum, kl_cnt, None, None


def _tree_rows_run(cp, fn, arrays, out_layouts, num_sums=0, name="attention"):
    """Prefix-tree rows on a mesh without a sequence split (``_context_plan``): ``fn(*arrays)`` in
    ``shard_map`` on each device's rows. Every array is per row (``[B, ...]``; None entries pass through), so
    only the batch axes split them (heads stay whole: the tree kernels see every head of a row)."""
    plan = dataclasses.replace(cp, heads=())
    live = [i for i, a in enumerate(arrays) if a is not None]

    def local(*xs):
        full = list(arrays)
        for i, x in zip(live, xs):
            full[i] = x
        return fn(*full)
    side = [(arrays[i], "b" + "." * (arrays[i].ndim - 1)) for i in live]
    return context_parallel.run(plan, local, side, [], [lay.replace("h", ".") for lay in out_layouts],
                                num_sums=num_sums, name=name)


def _msa_tree_rows_local(cp, q, k, v, qi, ki, cfg: ModelConfig, positions, segment_ids, indexer_kl, subtree_end,
                         input_weight, tree_keys):
    """``msa_block`` on prefix-tree rows, each device on its rows (``_tree_rows_run``); same returns."""
    sparse = indexer_kl != "dense"
    names = sorted(tree_keys) if tree_keys is not None else []

    def local(q, k, v, qi, ki, pos, seg, sub, wgt, *keys):
        tk = dict(zip(names, keys)) if tree_keys is not None else None
        o, kl_sum, kl_cnt, ids, lse = msa_block(q, k, v, qi, ki, cfg, pos, seg, indexer_kl, subtree_end=sub,
                                                input_weight=wgt, tree_keys=tk)
        return (o, ids, lse, kl_sum, kl_cnt) if sparse else (o, kl_sum, kl_cnt)

    res = _tree_rows_run(cp, local, [q, k, v, qi, ki, positions, segment_ids, subtree_end, input_weight,
                                     *(tree_keys[n] for n in names)],
                         ["bth.", "bht.", "bth"] if sparse else ["bth."], num_sums=2, name="msa")
    return _msa_result(res, sparse)


def mlp_block(p, x, cfg: ModelConfig, mlp_type: str):
    """MLP of one layer on normed input ``[B,T,H]``. Returns (out ``[B,T,H]``, load ``[E]`` float32)."""
    m = p["mlp"]
    if mlp_type == "dense":
        return dense_mlp(x, m["wi"], m["wo"], cfg), jnp.zeros((max(cfg.num_experts, 1),), jnp.float32)
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    weights, experts, load = route(xf, m["router"], m["router_bias"], cfg.num_experts_per_tok)
    y = moe_experts(xf, weights, experts, m["wi"], m["wo"], gated_activation(cfg), implementation=cfg.moe_impl)
    y = y * jnp.asarray(cfg.routed_scaling_factor, y.dtype)
    if "shared_wi" in m:
        y = y + dense_mlp(xf, m["shared_wi"], m["shared_wo"], cfg)
    return y.reshape(b, t, h), load


def decoder_layer(p, x, cfg, layer_type, mlp_type, positions, segment_ids, cos, sin, indexer_kl,
                  return_msa=False, subtree_end=None, input_weight=None, tree_keys=None):
    """One decoder layer. Returns (x_out, (load [E], kl_sum, kl_count, msa dict))."""
    a, kl_sum, kl_cnt, extra = attention_block(p, _norm(x, p["input_norm"], cfg), cfg, layer_type, positions,
                                               segment_ids, cos, sin, indexer_kl, return_msa, subtree_end,
                                               input_weight, tree_keys)
    h = constrain(x + a, ("batch", "length", "act_embed"))
    m, load = mlp_block(p, _norm(h, p["post_attn_norm"], cfg), cfg, mlp_type)
    return h + m, (load, kl_sum, kl_cnt, extra)


def _prepare(cfg, tokens, positions, segment_ids):
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    cos, sin = rope_frequencies(positions, cfg.rotary_dim, cfg.rope_theta)
    return positions.astype(jnp.int32), segment_ids.astype(jnp.int32), cos, sin


#: Primitives whose outputs ``remat="dots_kernels"`` saves besides matmuls. The fused kernels (Pallas
#: grouped matmuls, flash attention, MSA kernels; cuDNN's attention) sit behind custom VJPs, and under
#: ``jax.checkpoint`` the policy sees the ``custom_vjp_call`` (with its residuals: outputs, softmax
#: statistics), not the kernels inside; bare Pallas calls and cuDNN's forward primitive are listed too.
#: (This also keeps the custom-VJP MoE permutation's outputs.)
_KERNEL_PRIMITIVES = frozenset({"custom_vjp_call", "pallas_call", "dot_product_attention_fwd_wrapper"})


def _save_dots_and_kernels(prim, *args, **params) -> bool:
    """``jax.checkpoint`` policy of ``remat="dots_kernels"`` (see ``forward``)."""
    return prim.name in _KERNEL_PRIMITIVES or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(
        prim, *args, **params)


def _context_plan(cfg: ModelConfig, shape, subtree_end, input_weight, tree_keys):
    """The attention's ``shard_map`` plan (``minimax_jax.ops.context_parallel``: local rows and heads, and local
    queries against gathered keys on a sequence-sharded mesh) for ``[B, T]`` rows, or None: no mesh axis
    to split them over, or prefix-tree / weighted rows on a sequence-sharded mesh (left to GSPMD; without a
    sequence split they run on each device's rows)."""
    p = context_parallel.plan(shape[0], shape[1], (cfg.num_heads, cfg.num_kv_heads))
    if p is not None and (subtree_end is not None or input_weight is not None or tree_keys is not None):
        # tree visibility needs a row's own keys (T == S): its rows split over the batch axes, never its tokens
        return None if p.seq or not p.batch else p
    return p


def _balanced_order(cfg: ModelConfig, p) -> np.ndarray | None:
    """Zig-zag token order for context-parallel plan ``p`` when 2n divides the row, else None (also for the
    capacity MoE, whose dropped tokens depend on the row order)."""
    if p is None or p.size == 1 or cfg.moe_impl == "xla_capacity" or p.tokens % (2 * p.size):
        return None
    return context_parallel.zigzag(p.tokens, p.size)


def _layers(params, cfg, x, positions, segment_ids, cos, sin, indexer_kl, return_msa, subtree_end, input_weight,
            tree_keys, remat):
    """The decoder layers (scanned per stacked segment, unrolled over split ones): ``(x, loads, msa_out, kl_sum,
    kl_cnt)``."""
    loads, msa_out = [], []
    kl_sum, kl_cnt = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    for seg, sp in zip(layer_segments(cfg), params["segments"]):
        def body(carry, lp, seg=seg):
            y, aux = decoder_layer(lp, carry, cfg, seg.layer_type, seg.mlp_type, positions, segment_ids, cos, sin,
                                   indexer_kl, return_msa, subtree_end, input_weight, tree_keys)
            return y, aux

        if remat == "full":
            body = jax.checkpoint(body)
        elif remat == "dots":
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        elif remat == "dots_kernels":
            body = jax.checkpoint(body, policy=_save_dots_and_kernels)
        elif remat != "none":
            raise ValueError(f"remat must be none|full|dots|dots_kernels, got {remat!r}")
        if is_split(sp):    # split layers (params.split_layers): unrolled, each layer's weights read in place
            auxs = []
            for lp in sp:
                x, aux = body(x, lp)
                auxs.append(aux)
            load, ks, kc, extra = jax.tree.map(lambda *a: jnp.stack(a), *auxs)
        else:
            x, (load, ks, kc, extra) = jax.lax.scan(body, x, sp)
        if seg.mlp_type == "moe":
            loads.append(load)
        for j in range(seg.length if extra else 0):
            msa_out.append({"layer": seg.start + j, **jax.tree.map(lambda a, j=j: a[j], extra)})
        kl_sum, kl_cnt = kl_sum + ks.sum(), kl_cnt + kc.sum()
    return x, loads, msa_out, kl_sum, kl_cnt


def forward(params, cfg: ModelConfig, tokens: jax.Array, *, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, indexer_kl: str | None = None,
            return_hidden: bool = False, return_msa: bool = False, remat: str = "none",
            return_logits: bool = True, subtree_end: jax.Array | None = None,
            input_weight: jax.Array | None = None, tree_keys: dict | None = None) -> ModelOutput:
    """Full-sequence forward pass.

    Args:
      params: params tree (docs/ARCHITECTURE.md).
      cfg: the model config (static).
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 (default ``arange(T)``); packed documents restart at 0.
      segment_ids: ``[B, T]`` int32 document ids (default all 0); attention never crosses them.
      subtree_end: ``[B, T]`` int32 or None: prefix-tree rows (``minimax_jax.data.prefix_tree``): token j
        is visible only to tokens at slots ``j <= i < subtree_end[j]``; positions are per trajectory.
        MSA layers score, select and attend each token's own trajectory (its blocks are the unmerged ones).
      input_weight: ``[B, T]`` float or None: how many unmerged input positions each slot stands for
        (prefix-tree rows); weights the indexer-KL rows and their count, so the merged KL equals the
        unmerged one. None = 1 each.
      tree_keys: the packer's per-trajectory key layout (``prefix_tree.KEY_KEYS``) or None: MSA layers
        then gather each trajectory's keys into its own run and use the ordinary MSA kernels
        (``minimax_jax.model.msa_block``; with the indexer KL ``input_weight`` is needed too).
      indexer_kl: None, ``"sparse"`` (KL on the selected support) or ``"dense"`` (warm-up: dense
        attention in MSA layers, KL over the causal history).
      return_hidden: also return the pre-final-norm hidden state (input of MTP modules).
      return_msa: put each MSA layer's selected block ids and main-branch LSE in
        ``aux["msa"]``: a list (one entry per MSA layer, in layer order) of
        ``{"layer": i, "block_ids": [B,Hi,T,K], "lse": [B,T,H]}``.
      remat: ``"none"`` | ``"full"`` (recompute each layer in the backward pass) | ``"dots"``
        (save only matmul outputs) | ``"dots_kernels"`` (save matmul outputs and the outputs of the
        fused kernels: Pallas calls such as the grouped matmuls and flash attention, and cuDNN's
        attention forward, with their softmax statistics, so the backward pass re-runs none of them).
      return_logits: False skips the lm head: ``logits`` is None and ``head_input`` holds its input
        (for a chunked loss, ``minimax_jax.train.losses.chunked_cross_entropy_sums``, that never
        materialises ``[B,T,V]``).
    Returns: ``ModelOutput(logits [B,T,V] f32, hidden, aux, head_input)`` with ``aux["router_load"]``
      ``[num_moe_layers, E]`` tokens per expert, ``aux["indexer_kl_sum"]`` and
      ``aux["indexer_kl_count"]`` (float32 scalars).
    Raises: ValueError for a bad ``indexer_kl`` or token shape.
    """
    if indexer_kl not in INDEXER_KL_MODES:
        raise ValueError(f"indexer_kl must be one of {INDEXER_KL_MODES}, got {indexer_kl!r}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    positions, segment_ids, cos, sin = _prepare(cfg, tokens, positions, segment_ids)
    order = _balanced_order(cfg, _context_plan(cfg, tokens.shape, subtree_end, input_weight, tree_keys))
    if order is not None:            # context parallelism: the layers see the row in zig-zag order
        tokens, positions, segment_ids, cos, sin = (a[:, order] for a in (tokens, positions, segment_ids, cos, sin))
    x = constrain(embed(params, cfg, tokens), ("batch", "length", "act_embed"))
    with context_parallel.token_order(order):
        x, loads, msa_out, kl_sum, kl_cnt = _layers(params, cfg, x, positions, segment_ids, cos, sin, indexer_kl,
                                                    return_msa, subtree_end, input_weight, tree_keys, remat)
    if order is not None:            # natural order again for the head, the MTP modules and the losses
        inv = np.argsort(order)
        x = constrain(x[:, inv], ("batch", "length", "act_embed"))
        msa_out = [{**m, "block_ids": m["block_ids"][:, :, inv], "lse": m["lse"][:, inv]} for m in msa_out]
    hidden = x
    head_input = _norm(x, params["final_norm"], cfg)
    logits = constrain(unembed(params, cfg, head_input), ("batch", "length", "act_vocab")) if return_logits else None
    aux = {"router_load": jnp.concatenate(loads, 0) if loads else jnp.zeros((0, cfg.num_experts), jnp.float32),
           "indexer_kl_sum": kl_sum, "indexer_kl_count": kl_cnt}
    if return_msa:
        aux["msa"] = msa_out
    return ModelOutput(logits, hidden if return_hidden else None, aux, None if return_logits else head_input)


def mtp_forward(params, cfg: ModelConfig, hidden: jax.Array, tokens: jax.Array, *,
                positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                return_logits: bool = True, subtree_end: jax.Array | None = None) -> list[jax.Array]:
    """Multi-token-prediction heads (DeepSeek-V3 style, as M3 ships them).

    Depth d (1-based) predicts token ``t + d + 1`` at position t:
    ``h_d = layer_d(eh_proj([enorm(embed(tokens shifted left by d)), hnorm(h_{d-1})]))`` with
    ``h_0`` the main model's pre-final-norm hidden state, then ``logits_d = lm_head(final_norm_d(h_d))``.
    (Concatenation order embedding-first follows DeepSeek-V3's published MTP; M3's is assumed equal.)

    Args:
      hidden: ``[B,T,H]`` from ``forward(..., return_hidden=True)``.
      tokens: ``[B,T]`` the same input tokens.
      return_logits: False returns each depth's lm-head input (``[B,T,H]``, after that module's
        final norm) instead of its logits, for a chunked loss.
    Returns: list of ``num_mtp_modules`` logits ``[B,T,V]`` float32; positions whose shifted token
      falls off the end see token 0 and must be masked by the caller's loss.
    """
    if not cfg.num_mtp_modules:
        return []
    positions, segment_ids, cos, sin = _prepare(cfg, tokens, positions, segment_ids)
    lcfg, lt, mt = mtp_compute_kinds(cfg)
    h = hidden
    outs = []
    for d, mod in enumerate(params["mtp"], start=1):
        shifted = jnp.pad(tokens[:, d:], ((0, 0), (0, d)))
        e = _norm(embed(params, cfg, shifted), mod["enorm"], cfg)
        x = jnp.concatenate([e, _norm(h, mod["hnorm"], cfg)], axis=-1) @ mod["eh_proj"].astype(e.dtype)
        h, _ = decoder_layer(mod["layer"], x, lcfg, lt, mt, positions, segment_ids, cos, sin, None,
                             subtree_end=subtree_end)
        head_input = _norm(h, mod["final_norm"], cfg)
        outs.append(unembed(params, cfg, head_input) if return_logits else head_input)
    return outs
