"""bench/moe.py --ep-timing on CPU: with two host-platform devices the expert-parallel rows (EP MoE layer
forward and forward+backward, the token exchange alone, the same layer on one device) exist for M2 and M3
with positive times, the transport that ran is recorded (all_to_all; ragged_all_to_all is listed as not
run on CPU) and the EP rows carry the exchange share and the one-device comparison; with one device the
mode is skipped with its reason. The ragged exchange (GPU-only at run time) is traced and lowered here."""

from tests.paths import REPO_ROOT
import json
import os
import subprocess
import sys

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "bench", "moe.py")


def _env(devices):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    return env


def _run(out, devices, *args, timeout=240):
    r = subprocess.run([sys.executable, SCRIPT, f"--out={out}", "--tiny", "--ep-timing", "--variants=none",
                        "--tokens=64", "--reps=2", *args], capture_output=True, text=True, timeout=timeout,
                       env=_env(devices), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "moe.json")) as f:
        return json.load(f), r.stdout


def test_ep_timing_two_cpu_devices(tmp_path):
    res, stdout = _run(str(tmp_path), 2)
    ep = res["info"]["ep_timing"]
    assert ep["devices"] == 2 and ep["mesh"] == "expert=2" and ep["transports"] == ["all_to_all"]
    assert "ragged_all_to_all" in ep["not_run"] and ep["one_device_impl"] == "xla_ragged"
    assert res["skipped"] == []
    assert all(c["ok"] for c in res["checks"]), res["checks"]
    assert "expert_parallel[all_to_all,ep=2]" in [c["check"] for c in res["checks"]]
    rows = res["rows"]
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    for model in ("m2", "m3"):
        got = {(r["variant"], r["transport"], r["mode"]): r for r in rows if r["model"] == model}
        assert set(got) == {("ep_1dev", None, "fwd"), ("ep_1dev", None, "fwd+bwd"),
                            ("ep_exchange", "all_to_all", "dispatch+return"),
                            ("ep_moe", "all_to_all", "fwd"), ("ep_moe", "all_to_all", "fwd+bwd")}
        for r in got.values():
            assert r["ms"] > 0 and r["tokens"] == 64
            assert r["devices"] == (1 if r["variant"] == "ep_1dev" else 2)
            assert r["tokens_global"] == 64 * r["devices"]
        assert got[("ep_1dev", None, "fwd")]["moe"] == "xla_ragged"
        xch = got[("ep_exchange", "all_to_all", "dispatch+return")]
        assert xch["roundtrip_exact"] and xch["offdev_bytes_max"] > 0 and xch["gb_s"] > 0
        for mode, n_xch in (("fwd", 1), ("fwd+bwd", 2)):
            r = got[("ep_moe", "all_to_all", mode)]
            assert r["moe"] == "expert_parallel[all_to_all,xla,ep=2,tp=1]"
            assert r["tflop_s"] > 0
            assert abs(r["exchange_ms"] - n_xch * xch["ms"]) < 1e-9
            assert abs(r["exchange_share"] - r["exchange_ms"] / r["ms"]) < 1e-9
            one = got[("ep_1dev", None, mode)]
            assert r["one_device_ms"] == one["ms"] and abs(r["ep_over_1dev"] - r["ms"] / one["ms"]) < 1e-9
            assert abs(r["speedup_vs_1dev"] - 2 * one["ms"] / r["ms"]) < 1e-9
    assert "EP timing: mesh expert=2" in stdout and "ragged_all_to_all not run" in stdout


def test_ep_timing_needs_two_devices(tmp_path, monkeypatch, capsys):
    """bench/moe.py's ``main`` in this process (one CPU device here too; no interpreter start-up)."""
    import importlib

    import jax

    assert jax.device_count() == 1
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    monkeypatch.setattr(sys, "argv", [SCRIPT, f"--out={tmp_path}", "--tiny", "--ep-timing", "--variants=none",
                                      "--tokens=64", "--reps=2"])
    capsys.readouterr()
    importlib.import_module("moe").main()
    stdout = capsys.readouterr().out
    with open(os.path.join(tmp_path, "moe.json")) as f:
        res = json.load(f)
    why = "EP timing needs >= 2 devices; 1 visible (cpu)"
    assert res["info"]["ep_timing"] == {"skipped": why}
    assert res["skipped"] == [f"ep_timing: {why}"]
    assert res["rows"] == []
    assert f"EP timing skipped: {why}" in stdout


RAGGED_LOWERING = r"""
import sys
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as PS
import moe as B
from minimax_jax import sharding as sh
mesh = sh.make_mesh("expert=2")
xs = jax.ShapeDtypeStruct((2 * 32, 16), jnp.bfloat16, sharding=NamedSharding(mesh, PS("expert", None)))
ss = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(mesh, PS("expert")))
text = B._exchange_fn(mesh, "ragged_all_to_all", 2).lower(xs, ss).as_text()
print("ragged_all_to_all lowered", text.count("ragged_all_to_all"))
"""


def test_ragged_exchange_traces_on_cpu():
    """The ragged exchange does not run on CPU, but it must trace (shard_map types) and lower."""
    r = subprocess.run([sys.executable, "-c", RAGGED_LOWERING], capture_output=True, text=True, timeout=120,
                       env=_env(2), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ragged_all_to_all lowered 2" in r.stdout, r.stdout
