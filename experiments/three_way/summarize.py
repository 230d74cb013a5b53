"""Markdown tables of a three-way run (train_all.sh + eval_all.sh outputs) for RESULTS.md.

    python experiments/three_way/summarize.py [RESULTS_DIR]   # default experiments/three_way/results

Reads eval_<v>.json (task x length accuracy, perplexity, per-batch timing), metrics_<v>.jsonl or
metrics_long_<v>.jsonl (training curve), train_<v>.log (the step it stopped at), recall_msa.json and infer_<v>.txt (the stats line of infer.py) for the variants
msa / full / sliding (and msa_dense where eval_all.sh ran it), and prints: the accuracy table (a cell is blank where the length was not
reached in the time budget; with its 95 % interval where the eval file has one), a training summary and a timing summary.
"""

from __future__ import annotations

import json
import os
import re
import sys

CORE = ("msa", "full", "sliding")
# msa_dense (eval_all.sh): the MSA checkpoint with --attention dense; msa_top<N>: the MSA checkpoint selecting
# top-N blocks; listed only where their files exist.
OPTIONAL = ("msa_dense",)
_TOP = re.compile(r"eval_(msa_top\d+)\.json$")


def _variants(d: str) -> tuple[str, ...]:
    tops = sorted((m.group(1) for f in (os.listdir(d) if os.path.isdir(d) else ()) if (m := _TOP.match(f))),
                  key=lambda v: int(v[len("msa_top"):]))
    return CORE + tuple(v for v in OPTIONAL if os.path.exists(os.path.join(d, f"eval_{v}.json"))) + tuple(tops)


def _load(path):
    return json.load(open(path)) if os.path.exists(path) else None


def accuracy_table(d: str) -> str:
    evals = {v: _load(os.path.join(d, f"eval_{v}.json")) for v in _variants(d)}
    tasks = sorted({t for r in evals.values() if r for t in r["tasks"]})
    lengths = sorted({int(L) for r in evals.values() if r for by in r["tasks"].values() for L in by})
    head = "| task | attention | " + " | ".join(f"{L // 1024}K" for L in lengths) + " |"
    rows = [head, "|" + "---|" * (len(lengths) + 2)]
    for t in tasks:
        for v in evals:
            r = evals[v]
            by = r["tasks"].get(t, {}) if r else {}
            ci = (r.get("intervals") or {}).get(t, {}) if r else {}   # 95 % Wilson intervals (newer eval files)
            cells = [(f"{by[str(L)]:.2f}" + (f" [{ci[str(L)][0]:.2f}, {ci[str(L)][1]:.2f}]" if str(L) in ci else ""))
                     if str(L) in by else "" for L in lengths]
            rows.append(f"| {t} | {v} | " + " | ".join(cells) + " |")
    n = {v: (len(r["examples"]), len(r["skipped"])) for v, r in evals.items() if r}
    rows.append("")
    rows.append("Prompts scored / skipped by the time budget: "
                + ", ".join(f"{v} {a} / {b}" for v, (a, b) in n.items()))
    return "\n".join(rows)


def training_summary(d: str) -> str:
    rows = ["| attention | stopped at step | tokens (non-pad, approx.) | LM loss at first log (step) | "
            "LM loss at last log (step) | lr at last log | tokens/s (median) | held-out ppl |",
            "|---|---|---|---|---|---|---|---|"]
    for v in CORE:
        p = os.path.join(d, f"metrics_{v}.jsonl")
        if not os.path.exists(p):    # long_stage.sh's name (experiments/long_context/)
            p = os.path.join(d, f"metrics_long_{v}.jsonl")
        if not os.path.exists(p):
            continue
        m = [json.loads(line) for line in open(p)]
        tps = sorted(x.get("tokens_per_s", 0.0) for x in m)
        last = m[-1]
        log_every = (m[1]["step"] - m[0]["step"]) if len(m) > 1 else 1
        tokens = sum(x.get("tokens", 0.0) for x in m) * log_every
        ev = _load(os.path.join(d, f"eval_{v}.json")) or {}
        ppl = ev.get("perplexity", {}).get("perplexity")
        stop = _stop_step(os.path.join(d, f"train_{v}.log"))
        steps = stop if stop is not None else last["step"]
        tokens *= steps / last["step"]
        ppl_s = f"{ppl:.1f}" if ppl else ""
        rows.append(f"| {v} | {steps} | {tokens / 1e6:.1f}M | {m[0]['lm_loss']:.2f} ({m[0]['step']}) | "
                    f"{last['lm_loss']:.2f} ({last['step']}) | {last.get('lr', float('nan')):.2e} | "
                    f"{tps[len(tps) // 2]:.0f} | {ppl_s} |")
    return "\n".join(rows)


def _stop_step(log_path: str) -> int | None:
    """The step train.py reported when it stopped (completed or preempted), from its log."""
    if not os.path.exists(log_path):
        return None
    found = re.findall(r"train\.py: (?:completed|preempted) at step (\d+)", open(log_path, errors="replace").read())
    return int(found[-1]) if found else None


def timing_summary(d: str) -> str:
    rows = ["| attention | prompt tokens | TTFT s | prefill s | decode tok/s | implementations |", "|---|---|---|---|---|---|"]
    # infer.py's stats line, the current form ("prefill 2.35s (compiled in 2.18s) | ... : decode 66.1 tok/s
    # steady state") and the older one ("... in 3.0s (21.3 tok/s)")
    pat = re.compile(r"prompt (\d+) tok, prefill ([\d.]+)s(?: \(compiled in [\d.]+s\))? \| TTFT ([\d.]+)s \| "
                     r"generated \d+ tok in [\d.]+s(?: \(([\d.]+) tok/s\)|: decode ([\d.]+|n/a) tok/s)")
    for v in _variants(d):
        p = os.path.join(d, f"infer_{v}.txt")
        if not os.path.exists(p):
            continue
        text = open(p).read()
        m = pat.search(text)
        impl = re.search(r"implementations: (.*)", text)
        if m:
            rows.append(f"| {v} | {m.group(1)} | {m.group(3)} | {m.group(2)} | {m.group(4) or m.group(5)} | "
                        f"{impl.group(1) if impl else ''} |")
    rec = _load(os.path.join(d, "recall_msa.json"))
    if rec:
        rows += ["", f"Indexer block recall vs dense attention's top blocks (MSA checkpoint): mean {rec['mean']:.3f} "
                 f"over {rec['pairs']} (query, group) pairs; per layer "
                 + ", ".join(f"{k}: {v:.3f}" for k, v in sorted(rec["layers"].items(), key=lambda kv: int(kv[0])))]
        if "mass" in rec:   # recall files written since session 42
            rows[-1] += (f"; dense attention mass inside the selection {rec['mass']['mean']:.3f} of the "
                         f"{rec['oracle_mass']['mean']:.3f} the top blocks hold")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    d = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    print("### Accuracy (contains-all-answers), per task and context length\n")
    print(accuracy_table(d))
    print("\n### Training\n")
    print(training_summary(d))
    print("\n### Time per token (infer.py)\n")
    print(timing_summary(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
