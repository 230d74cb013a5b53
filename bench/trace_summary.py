"""Where the device time of a profiled run went: the top ops of a ``jax.profiler`` trace.

    python bench/trace_summary.py PROFILE_DIR [--top 25] [--steps N]

``PROFILE_DIR`` is the folder given to ``jax.profiler.trace(..., create_perfetto_trace=True)`` (the
newest ``plugins/profile/*/perfetto_trace.json.gz`` under it is read). For every device process of the
trace (``/device:GPU:0`` ...) and every line of it (XLA's "XLA Ops" line names HLO ops / fusions, the
"Stream #..." lines name CUDA kernels), the complete events ("ph" == "X") are summed by name; the
summary lists each line's busy time and its ``--top`` names by total time, with counts and shares.
``--steps`` divides the times by the number of profiled steps (ms per step).

The JSON form is the Chrome / Perfetto trace-event format that JAX writes (``traceEvents`` with
``process_name`` / ``thread_name`` metadata events). The script uses only the standard library so it
runs wherever the trace is copied to.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys


def newest_trace(profile_dir: str) -> str:
    """Path of the newest ``perfetto_trace.json.gz`` under ``profile_dir`` (or ``profile_dir`` itself
    when it is a trace file).

    Raises:
      FileNotFoundError: the path does not exist, or no trace is under it.
    """
    if os.path.isfile(profile_dir):
        return profile_dir
    if not os.path.isdir(profile_dir):
        raise FileNotFoundError(f"{profile_dir} does not exist")
    paths = glob.glob(os.path.join(profile_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {profile_dir} (was the trace taken with "
                                "create_perfetto_trace=True?)")
    return max(paths, key=os.path.getmtime)


def line_names(events: list[dict]) -> tuple[dict, dict]:
    """``({pid: process name}, {(pid, tid): line name})`` from the trace's metadata ("ph" == "M") events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", str(e["pid"]))
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", str(e.get("tid")))
    return procs, threads


def summarize(events: list[dict], top: int = 25, steps: int = 1, device_only: bool = True) -> list[dict]:
    """Per (process, line): busy ms and the ``top`` event names by total ms, all divided by ``steps``.

    Args:
      events: trace events (dicts with ph / pid / tid / name / dur in microseconds).
      device_only: keep only processes whose name starts with ``/device:``.
    Returns:
      list of {"process", "line", "busy_ms", "events", "top": [{"name", "ms", "count", "share"}]},
      busiest line first.
    """
    procs, threads = line_names(events)
    sums: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        pname = procs.get(e.get("pid"), str(e.get("pid")))
        if device_only and not pname.startswith("/device:"):
            continue
        key = (pname, threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))))
        acc = sums[key][e.get("name", "?")]
        acc[0] += float(e["dur"]) / 1000.0
        acc[1] += 1
    out = []
    for (pname, line), by_name in sums.items():
        busy = sum(v[0] for v in by_name.values())
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        out.append({"process": pname, "line": line, "busy_ms": busy / steps,
                    "events": sum(v[1] for v in by_name.values()),
                    "top": [{"name": n, "ms": v[0] / steps, "count": v[1] / steps,
                             "share": v[0] / busy if busy else 0.0} for n, v in ranked]})
    return sorted(out, key=lambda r: -r["busy_ms"])


def load_events(path: str) -> list[dict]:
    """Trace events of a (gzipped) trace-event JSON file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def format_summary(rows: list[dict], max_lines: int = 4) -> str:
    """Human-readable table of ``summarize``'s rows (the busiest ``max_lines`` lines)."""
    out = []
    for r in rows[:max_lines]:
        out.append(f"{r['process']} / {r['line']}: busy {r['busy_ms']:.2f} ms ({r['events']} events)")
        for t in r["top"]:
            out.append(f"  {t['ms']:9.3f} ms  {100 * t['share']:5.1f}%  x{t['count']:<6g} {t['name'][:110]}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile_dir", help="the folder given to jax.profiler.trace, or a perfetto_trace.json.gz")
    p.add_argument("--top", type=int, default=25, help="names listed per line (by total time)")
    p.add_argument("--steps", type=int, default=1, help="profiled steps (times are divided by it)")
    p.add_argument("--all-processes", action="store_true", help="include host (CPU) processes")
    a = p.parse_args(argv)
    if a.steps < 1 or a.top < 1:
        p.error("--steps and --top must be >= 1")
    try:
        path = newest_trace(a.profile_dir)
        events = load_events(path)
    except (OSError, ValueError) as e:      # missing / unreadable / not JSON
        print(f"trace_summary: {e}", file=sys.stderr)
        return 2
    rows = summarize(events, a.top, a.steps, device_only=not a.all_processes)
    print(f"{path}")
    print(format_summary(rows) if rows else
          "no device events in the trace (a CPU run has none: --all-processes lists the host's lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
