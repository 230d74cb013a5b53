"""Peak host memory of the streaming converter is bounded by a small multiple of the largest layer,
not by the model: two synthetic multi-GB checkpoints (same width, 6 and 12 layers) are converted
in child processes whose peak RSS (``ru_maxrss``) is measured. Slow (writes ~6 GB): run with
``pytest -m slow tests/convert/test_convert_memory.py``."""

import json
import os
import subprocess
import sys

import pytest

from minimax_jax.convert.synthetic import wide_config, write_synthetic_checkpoint

_CHILD = r"""
import json, resource, sys, time
import numpy as np, jax, orbax.checkpoint, tensorstore  # noqa: F401  (imports count as baseline)
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
import minimax_jax.model.params  # noqa: F401
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.time()
cfg, rep = convert_hf_to_orbax(sys.argv[1], sys.argv[2], "bfloat16", progress=False)
dt = time.time() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"base_kb": base, "peak_kb": peak, "seconds": dt, "bytes": rep["source_bytes"]}))
"""


def _convert_in_child(src, dst):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", _CHILD, src, dst], env=env, check=True, capture_output=True,
                         text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _layer_bytes(cfg):
    """Bytes of one decoder layer (bf16 weights, float32 router) = the largest layer here."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    attn = 2 * (H * cfg.q_dim * 2 + H * cfg.kv_dim * 2 + cfg.q_dim + cfg.kv_dim + 2 * H)
    return attn + 2 * 3 * E * H * I + 4 * (H * E + E)


@pytest.mark.slow
def test_peak_rss_bounded_by_layer_not_model(tmp_path):
    results = {}
    for layers in (6, 12):
        cfg = wide_config(hidden=2048, layers=layers, experts=16, inter=1536, vocab=32000)
        src = str(tmp_path / f"src{layers}")
        total = write_synthetic_checkpoint(cfg, src)
        r = _convert_in_child(src, str(tmp_path / f"out{layers}"))
        layer = _layer_bytes(cfg)
        r.update(total=total, layer=layer, delta=(r["peak_kb"] - r["base_kb"]) * 1024)
        results[layers] = r
        print(f"layers={layers}: checkpoint {total / 1e9:.2f} GB, largest layer {layer / 1e6:.0f} MB, "
              f"baseline RSS {r['base_kb'] / 1e3:.0f} MB, peak RSS {r['peak_kb'] / 1e3:.0f} MB "
              f"(+{r['delta'] / 1e6:.0f} MB = {r['delta'] / layer:.2f} layers), {r['bytes'] / 1e9 / r['seconds']:.3f} GB/s")
        assert r["delta"] <= 4 * layer, r
        assert r["peak_kb"] * 1024 < total / 2, r
        import shutil

        shutil.rmtree(src)
        shutil.rmtree(tmp_path / f"out{layers}")
    assert results[12]["total"] > 4e9
    # doubling the depth (and the checkpoint) leaves the peak where it was (within half a layer)
    assert results[12]["delta"] - results[6]["delta"] < results[12]["layer"] / 2, results
