"""Where the needle's block ranks for the last prompt query: dense attention mass vs the MSA indexer, per layer and group.

    python experiments/long_context/needle_ranks.py --checkpoint DIR [--length 8192] [--num 3]

For each `niah_single` prompt (the eval's generator, seeded) and each MSA layer / kv group: the needle block's share of
the group's head-averaged dense attention mass at the last prompt token, its rank under that mass (1 = heaviest), its
rank under the indexer's block scores (max over the block's keys; the local block excluded, as MSA always keeps it)
and both top-6 lists. RESULTS.md ("Second MSA run") reads it. fp32 HIGHEST products; one forward per prompt.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.chat.tokens import BOS
from minimax_jax.data.haystack import prose_haystack, token_counter
from minimax_jax.data.tasks import generate_suite
from minimax_jax.infer.loading import load_model
from minimax_jax.model.layers import rms_norm, rope_frequencies
from minimax_jax.model.params import layer_segments, unstack_layers
from minimax_jax.model.transformer import decoder_layer, embed, project_index, project_qkv
from minimax_jax.ops.msa.common import HIGHEST


def block_scores(q, k, qi, ki, nb, bs):
    """Last query: head-averaged dense mass per block [G, nb] and index scores per block [G, nb]."""
    t = k.shape[0]
    g, h = k.shape[1], q.shape[0]
    s = jnp.einsum("gjd,sgd->gjs", q.reshape(g, h // g, -1), k, precision=HIGHEST) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(s, -1).mean(1)
    mass = jnp.pad(p, ((0, 0), (0, nb * bs - t))).reshape(g, nb, bs).sum(-1)
    si = jnp.einsum("gd,sd->gs", qi, ki, precision=HIGHEST)
    idx = jnp.pad(si, ((0, 0), (0, nb * bs - t)), constant_values=-jnp.inf).reshape(g, nb, bs).max(-1)
    return np.asarray(mass), np.asarray(idx)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--num", type=int, default=3)
    a = ap.parse_args(argv)
    m = load_model(a.checkpoint)
    cfg, params, tok = m.cfg, m.params, m.tokenizer
    bs = cfg.index_block_size
    kinds = [(s.layer_type, s.mlp_type) for s in layer_segments(cfg) for _ in range(s.length)]
    layers = unstack_layers(params, cfg)
    for e in generate_suite(["niah_single"], [a.length], a.num, token_counter(tok), prose_haystack(heldout_works=4, seed=0),
                            seed=0):
        text = BOS + e.prompt
        enc = tok.encode(text)
        at = text.find(e.answers[0])
        needle = next(i for i, (lo, hi) in enumerate(enc.offsets) if lo <= at < hi or lo >= at)
        t = len(enc.ids)
        nb, nblk = -(-t // bs), needle // bs
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        seg = jnp.zeros_like(pos)
        cos, sin = rope_frequencies(pos, cfg.rotary_dim, cfg.rope_theta)
        x = embed(params, cfg, jnp.asarray(enc.ids, jnp.int32)[None])
        print(f"prompt of {t} tokens, needle at token {needle} (block {nblk} of {nb}), answer {e.answers[0]}")
        for li, (lp, (lt, mt)) in enumerate(zip(layers, kinds)):
            if lt == "msa":
                h = rms_norm(x, lp["input_norm"]["scale"], eps=cfg.rms_norm_eps, kind=cfg.norm_kind)
                q, k, _ = project_qkv(lp, h, cfg, cos, sin)
                qi, ki = project_index(lp, h, cfg, cos, sin)
                mass, idx = block_scores(q[0, -1].astype(jnp.float32), k[0].astype(jnp.float32),
                                         qi[0, -1].astype(jnp.float32), ki[0].astype(jnp.float32), nb, bs)
                for g in range(mass.shape[0]):
                    free = idx[g, :-1]                                   # the local block is always kept
                    rank_i = "local" if nblk == nb - 1 else int((free > free[nblk]).sum()) + 1
                    print(f"  layer {li} group {g}: needle mass {mass[g, nblk]:.3f}, dense rank "
                          f"{int((mass[g] > mass[g, nblk]).sum()) + 1}, index rank {rank_i} of {nb - 1}; dense top "
                          f"{np.argsort(-mass[g])[:6].tolist()}, index top {np.argsort(-free)[:6].tolist()}")
            x = decoder_layer(lp, x, cfg, lt, mt, pos, seg, cos, sin, None)[0]


if __name__ == "__main__":
    main()
