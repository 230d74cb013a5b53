"""Conversion throughput: synthetic HF checkpoint (BF16 or FP8 hub layout) -> orbax, and back.

    python bench/convert.py [--layers 8] [--hidden 2048] [--experts 16] [--fp8] [--compress]
                            [--export] [--workdir /tmp/convert_bench] [--json out.json]

Reports GB/s of source bytes over wall time and over this process's CPU time (user + system, all
threads): on a shared machine the wall figure depends on the load, the CPU figure much less.
Peak RSS is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minimax_jax.convert.export import export_orbax_to_hf  # noqa: E402
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax  # noqa: E402
from minimax_jax.convert.synthetic import wide_config, write_synthetic_checkpoint  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--inter", type=int, default=1536)
    p.add_argument("--fp8", action="store_true", help="FP8 e4m3 + 128x128 scale_inv source")
    p.add_argument("--compress", action="store_true", help="zstd-compress orbax chunks")
    p.add_argument("--export", action="store_true", help="also time orbax -> safetensors export")
    p.add_argument("--in-flight", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/convert_bench")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    cfg = wide_config(hidden=a.hidden, layers=a.layers, experts=a.experts, inter=a.inter)
    src, dst, back = (os.path.join(a.workdir, n) for n in ("hf", "orbax", "hf_back"))
    shutil.rmtree(a.workdir, ignore_errors=True)
    total = write_synthetic_checkpoint(cfg, src, fp8=a.fp8)
    os.sync()
    res = {"layers": a.layers, "hidden": a.hidden, "experts": a.experts, "fp8": a.fp8, "compress": a.compress,
           "source_gb": total / 1e9, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    t, c = time.time(), _cpu()
    _, rep = convert_hf_to_orbax(src, dst, "bfloat16", progress=False, compress=a.compress,
                                 max_in_flight=a.in_flight)
    wall, cpu = time.time() - t, _cpu() - c
    res.update(convert_wall_s=wall, convert_cpu_s=cpu, convert_gb_s_wall=total / 1e9 / wall,
               convert_gb_s_cpu=total / 1e9 / cpu)
    if a.export:
        t, c = time.time(), _cpu()
        out = export_orbax_to_hf(dst, back, fp8=a.fp8, progress=False)
        wall, cpu = time.time() - t, _cpu() - c
        res.update(export_gb=out["bytes"] / 1e9, export_wall_s=wall, export_cpu_s=cpu,
                   export_gb_s_wall=out["bytes"] / 1e9 / wall, export_gb_s_cpu=out["bytes"] / 1e9 / cpu)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    res["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
