"""Where the needle's block ranks for the last prompt query: dense attention mass vs the MSA indexer, per layer and group.

    python experiments/long_context/needle_ranks.py --checkpoint DIR [--length 8192] [--num 3]
    python experiments/long_context/needle_ranks.py --checkpoint DIR --length 4096 --eval_json EVAL.json   # multi-value

For each `niah_single` prompt (the eval's generator, seeded) and each MSA layer / kv group: the needle block's share of
the group's head-averaged dense attention mass at the last prompt token, its rank under that mass (1 = heaviest), its
rank under the indexer's block scores (max over the block's keys; the local block excluded, as MSA always keeps it)
and both top-6 lists. RESULTS.md ("Second MSA run") reads it. fp32 HIGHEST products; one forward per prompt.
"""

from __future__ import annotations

import argparse
import json
import re

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


def ranks_at(cfg, params, tok, text, targets, label):
    """Print, per MSA layer and group, where each target string's block ranks for the LAST token of ``text``."""
    bs = cfg.index_block_size
    kinds = [(s.layer_type, s.mlp_type) for s in layer_segments(cfg) for _ in range(s.length)]
    layers = unstack_layers(params, cfg)
    enc = tok.encode(text)
    t = len(enc.ids)
    nb = -(-t // bs)
    blocks = []
    for a in targets:
        at = text.find(a)
        blocks.append(next(i for i, (lo, hi) in enumerate(enc.offsets) if lo <= at < hi or lo >= at) // bs)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    seg = jnp.zeros_like(pos)
    cos, sin = rope_frequencies(pos, cfg.rotary_dim, cfg.rope_theta)
    x = embed(params, cfg, jnp.asarray(enc.ids, jnp.int32)[None])
    print(f"{label}: {t} tokens ({nb} blocks); targets {list(targets)} in blocks {blocks}")
    for li, (lp, (lt, mt)) in enumerate(zip(layers, kinds)):
        if lt == "msa":
            h = rms_norm(x, lp["input_norm"]["scale"], eps=cfg.rms_norm_eps, kind=cfg.norm_kind)
            q, k, _ = project_qkv(lp, h, cfg, cos, sin)
            qi, ki = project_index(lp, h, cfg, cos, sin)
            mass, idx = block_scores(q[0, -1].astype(jnp.float32), k[0].astype(jnp.float32),
                                     qi[0, -1].astype(jnp.float32), ki[0].astype(jnp.float32), nb, bs)
            for g in range(mass.shape[0]):
                free = idx[g, :-1]                                   # the local block is always kept
                cells = []
                for b in blocks:
                    rank_i = "local" if b == nb - 1 else int((free > free[b]).sum()) + 1
                    cells.append(f"mass {mass[g, b]:.3f} dense rank {int((mass[g] > mass[g, b]).sum()) + 1} "
                                 f"index rank {rank_i}")
                print(f"  layer {li} group {g}: " + " | ".join(cells))
        x = decoder_layer(lp, x, cfg, lt, mt, pos, seg, cos, sin, None)[0]


def _decode_point(output: str, answers) -> tuple[str, list[str], list[str]]:
    """The output's prefix through its last new correct value (and the separator after it, if any): the point
    after which the model ended the list or repeated a value instead of giving a missing one; the values found,
    the values missing."""
    found, end = [], 0
    for mt in re.finditer(r"\d{7}", output):
        v = mt.group(0)
        if v in answers and v not in found:
            found.append(v)
            rest = output[mt.end():]
            end = mt.end() + len(rest) - len(rest.lstrip(", "))
        else:
            break
    return output[:end], found, [a for a in answers if a not in found]


def _eval_examples(path: str, task: str, length: int) -> dict:
    """The eval CLI JSON's ``task`` examples at ``length``, keyed by their answers; SystemExit (one line) for a file
    that is not such a JSON, or has none there."""
    try:
        with open(path) as f:
            data = json.load(f)
        examples = data["examples"]
        rows = [e for e in examples if e["task"] == task and e["target_length"] == length]
        by_answers = {tuple(e["answers"]): e for e in rows}
        lacking = sorted({k for e in rows for k in ("output", "score") if k not in e})
        if lacking:
            raise KeyError(f"examples without {lacking}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"needle_ranks.py: error: --eval_json {path}: not the eval CLI's JSON "
                         f"({type(e).__name__}: {e})")
    if not rows:
        have = sorted({e.get("target_length") for e in examples if isinstance(e, dict) and e.get("task") == task})
        raise SystemExit(f"needle_ranks.py: error: --eval_json {path} has no {task} examples at --length {length} "
                         f"(lengths there: {have or 'none'})")
    if len(by_answers) != len(rows):
        raise SystemExit(f"needle_ranks.py: error: --eval_json {path} repeats {task} prompts at {length} "
                         f"({len(rows)} examples, {len(by_answers)} distinct): one eval run's JSON, please")
    if data.get("attention", "as_trained") != "as_trained":
        print(f"warning: --eval_json ran with --attention {data['attention']}; the ranks below are the MSA model's")
    return by_answers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--num", type=int, default=3,
                    help="niah_single prompts (multi-value mode: every prompt of the JSON)")
    ap.add_argument("--eval_json", default=None,
                    help="multi-value mode: the eval CLI's JSON of this checkpoint (default prompts: seed 0, no chat, "
                         "BOS); for each niah_multivalue prompt at --length whose output missed a value, the ranks at "
                         "the output's last token that gave a new correct value (or its separator after it): the "
                         "token after which the model ended or repeated instead of giving the next value")
    a = ap.parse_args(argv)
    task = "niah_multivalue" if a.eval_json else "niah_single"
    outputs = _eval_examples(a.eval_json, task, a.length) if a.eval_json else {}
    m = load_model(a.checkpoint)
    cfg, params, tok = m.cfg, m.params, m.tokenizer
    num = len(outputs) if a.eval_json else a.num
    missed = 0
    for e in generate_suite([task], [a.length], num, token_counter(tok), prose_haystack(heldout_works=4, seed=0),
                            seed=0):
        if not a.eval_json:
            ranks_at(cfg, params, tok, BOS + e.prompt, e.answers[:1], f"last prompt token, answer {e.answers[0]}")
            continue
        got = outputs.get(tuple(e.answers))
        if got is None:
            raise SystemExit(f"needle_ranks.py: error: --eval_json has no output for answers {e.answers}: "
                             "another seed, haystack or length?")
        if got["score"] >= 1:
            continue
        missed += 1
        prefix, found, missing = _decode_point(got["output"], e.answers)
        ranks_at(cfg, params, tok, BOS + e.prompt + prefix, missing + found,
                 f"output {got['output'][:60]!r}: query after {prefix!r}; missing {missing}, found {found}")
    if a.eval_json:
        print(f"{num} {task} prompts at {a.length} tokens, {missed} missed a value (ranks above)")


if __name__ == "__main__":
    main()
