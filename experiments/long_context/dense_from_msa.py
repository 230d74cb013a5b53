"""Write a dense copy of an MSA checkpoint: every ``msa`` layer becomes ``full`` attention and its index
branch (index projections and norms) is dropped; every other weight is kept bit for bit.

Issue 31's recipe starts from a dense model trained at short rows; the repository ships one trained
model (``checkpoints/demo``, MSA on layers 2-5), whose backbone runs as exact attention with its index
branches unused (``--attention dense``). This makes that backbone an ordinary dense checkpoint, which
``train.py`` then extends to long rows (``init.mode=checkpoint``) and turns back into MSA with fresh
index branches (``init.mode=sparse_cpt``).

    python experiments/long_context/dense_from_msa.py --src checkpoints/demo --dst /tmp/lc/dense0
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True, help="MSA checkpoint directory (config.yaml, params/, tokenizer.json)")
    p.add_argument("--dst", required=True, help="new directory for the dense checkpoint")
    a = p.parse_args()

    from minimax_jax.convert.load import load_checkpoint
    from minimax_jax.convert.save import save_checkpoint
    from minimax_jax.model.params import add_index_params

    cfg, params = load_checkpoint(a.src)
    if not cfg.has_msa:
        raise SystemExit(f"dense_from_msa: {a.src} has no msa layer (layer_types {list(cfg.layer_types)})")
    dense = cfg.replace(layer_types=tuple("full" if t == "msa" else t for t in cfg.layer_types))
    out = add_index_params(params, cfg, dense, jax.random.key(0))   # drops index_* where a layer is not msa
    tok = os.path.join(a.src, "tokenizer.json")
    save_checkpoint(out, dense, a.dst, tokenizer=tok if os.path.isfile(tok) else None, sources=(a.src,))
    n_in, n_out = (sum(np.size(v) for v in jax.tree.leaves(t)) for t in (params, out))
    print(f"dense_from_msa: {a.src} -> {a.dst}: layer_types {list(dense.layer_types)}, "
          f"{n_out:,} of {n_in:,} weights kept ({n_in - n_out:,} index-branch weights dropped)")


if __name__ == "__main__":
    main()
