"""How long does the copy-task plateau last, and what shortens it? (RESULTS.md, run 4 follow-up)

Runs ``induction.py train`` (2 dense full-attention layers of the demo config, random 48-token
sequences repeated once, batch 32, bf16) once per variant, ``--jobs`` at a time, each in its own
process (single-threaded on the CPU), and appends one JSON line per variant to ``--out``:
``{"name", "args", "curve": [repeat NLL every --log_every steps], "seconds"}``; each variant's
progress is in ``<out>.<name>.log`` as it runs.

    python experiments/learnability/plateau_sweep.py --steps 800 --out /tmp/plateau.jsonl \\
        [--only base,qknorm_none] [--platform gpu --jobs 4]

The plateau is the repeat loss staying at ln(vocab) (8.32 for 4,096 tokens); a variant "leaves" it
at the first logged step whose repeat loss is below ln(vocab) - 0.5.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

BASE = ["--set", "dtype=bfloat16"]
V4096 = ["--set", "vocab_size=4096"]
# name -> extra arguments of induction.py train (all at vocab 4096 unless the name says otherwise)
VARIANTS = {
    "base": V4096,
    "vocab2048": ["--set", "vocab_size=2048"],
    "qknorm_none": V4096 + ["--set", "qk_norm=none"],
    "rope_full": V4096 + ["--set", "rotary_dim=64"],
    "trainopt": V4096 + ["--optimizer", "train"],
    "lr1e-2": V4096 + ["--lr", "1e-2"],
    "width512": V4096 + ["--set", "hidden_size=512", "--set", "dense_intermediate_size=1536"],
    "init0.1": V4096 + ["--set", "initializer_range=0.1"],
    "heads8": V4096 + ["--set", "num_heads=8", "--set", "num_kv_heads=8", "--set", "head_dim=32",
                       "--set", "rotary_dim=16"],
    "tied": V4096 + ["--set", "tie_word_embeddings=true"],
    "vocab2048_tied": ["--set", "vocab_size=2048", "--set", "tie_word_embeddings=true"],
}
# Random-offset copying (induction.py --offset random: the copy distance varies per row, so only a real
# induction circuit solves it; session 7).
T2048 = ["--set", "vocab_size=2048", "--set", "tie_word_embeddings=true", "--offset", "random"]
VARIANTS.update({
    "rand_tied2048": T2048,
    "rand_untied2048": ["--set", "vocab_size=2048", "--offset", "random"],
    "rand_tied2048_lr1e-2": T2048 + ["--lr", "1e-2"],
    "rand_tied2048_trainopt": T2048 + ["--optimizer", "train"],
    "rand_tied2048_6layers": T2048 + ["--layers", "6"],
    "rand_tied512": ["--set", "vocab_size=512", "--set", "tie_word_embeddings=true", "--offset", "random"],
    "rand_tied2048_noqknorm": T2048 + ["--set", "qk_norm=none"],
    "rand_tied2048_rope64": T2048 + ["--set", "rotary_dim=64", "--set", "rope_theta=10000.0"],
    "rand_tied2048_b256": T2048 + ["--batch", "256"],
    "rand_tied2048_b256_lr1e-3": T2048 + ["--batch", "256", "--lr", "1e-3"],
    "rand_tied2048_b256_seq24": T2048 + ["--batch", "256", "--seq", "24"],
    "rand_tied512_b256": ["--set", "vocab_size=512", "--set", "tie_word_embeddings=true", "--offset", "random",
                          "--batch", "256"],
    "rand_tied512_b256_lr1e-3": ["--set", "vocab_size=512", "--set", "tie_word_embeddings=true", "--offset",
                                 "random", "--batch", "256", "--lr", "1e-3"],
    "rand_tied2048_heads8": T2048 + ["--set", "num_heads=8", "--set", "num_kv_heads=8", "--set", "head_dim=32",
                                     "--set", "rotary_dim=16"],
})


def run_variant(name: str, steps: int, log_every: int, platform: str, jobs: int, out: str) -> dict:
    args = BASE + VARIANTS[name] + ["--steps", str(steps), "--log_every", str(log_every)]
    # induction.py imports minimax_jax: from the repository, whether or not the package is installed
    base_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if platform == "cpu":
        env = dict(base_env, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
                   OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    else:   # processes share the GPU: split its memory instead of each preallocating 75%
        env = dict(base_env, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / jobs:.3f}")
    t0 = time.time()
    log_path = f"{out}.{name}.log"
    with open(log_path, "w") as fh:
        p = subprocess.run([sys.executable, "-u", os.path.join(HERE, "induction.py"), "train", *args], cwd=ROOT,
                           env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
    text = open(log_path).read()
    if p.returncode:
        raise RuntimeError(f"variant {name} failed:\n{text[-3000:]}")
    curve = [float(m) for m in re.findall(r"repeat NLL ([0-9.naif]+)", text)]
    return {"name": name, "args": args, "curve": curve, "log_every": log_every, "seconds": round(time.time() - t0)}


def left_plateau(row: dict, vocab: int) -> int | None:
    """First logged step whose repeat loss is below ln(vocab) - 0.5, or None."""
    for i, v in enumerate(row["curve"]):
        if v < math.log(vocab) - 0.5:
            return i * row["log_every"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--log_every", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        futs = {ex.submit(run_variant, n, a.steps, a.log_every, a.platform, a.jobs, a.out): n for n in names}
        for f in cf.as_completed(futs):
            row = f.result()
            with open(a.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            vocab = int(next(a.split("=", 1)[1] for a in row["args"] if a.startswith("vocab_size=")))
            print(f"{row['name']:>12}: left plateau at {left_plateau(row, vocab)}; last {row['curve'][-1]:.3f} "
                  f"({row['seconds']} s)", flush=True)


if __name__ == "__main__":
    main()
