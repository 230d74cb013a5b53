"""``infer.py --mesh``: parameters restored sharded over 2 (simulated CPU) devices, same output."""

from tests.paths import REPO_ROOT
import json
import os
import subprocess
import sys

from tests import infer_helpers as H

ROOT = REPO_ROOT


def test_cli_on_a_two_device_mesh(tmp_path):
    ckpt = H.chain_checkpoint(str(tmp_path / "ckpt"), H.GOOD_PIECES)
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps(H.CHAT))
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "infer.py"), f"--checkpoint={ckpt}",
                        f"--chat_file={chat}", "--temperature=0", "--mesh=fsdp=2"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--- generation ---\n" + "".join(H.GOOD_PIECES[:-1]) + "\n" in r.stdout
    assert "mesh fsdp=2" in r.stderr


def _cli(tmp_path, *flags, **cfg_kw):
    ckpt = H.chain_checkpoint(str(tmp_path / "ckpt"), H.GOOD_PIECES, **cfg_kw)
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps(H.CHAT))
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    return subprocess.run([sys.executable, os.path.join(ROOT, "infer.py"), f"--checkpoint={ckpt}",
                           f"--chat_file={chat}", "--temperature=0", *flags],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_cli_context_parallel_prefill(tmp_path):
    """``--mesh sequence=2``: each 16-token prefill chunk split over the two devices, the same output;
    ``--show_stats`` names the context-parallel prefill that ran."""
    r = _cli(tmp_path, "--mesh=sequence=2", "--prefill_chunk=16", "--show_stats")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--- generation ---\n" + "".join(H.GOOD_PIECES[:-1]) + "\n" in r.stdout
    assert "prefill: context parallel over sequence=2, 16-token chunks (8 per device)" in r.stderr
    assert "mesh_attention/gather=sequence=2,heads=-,order=zigzag" in r.stderr


def test_cli_prefill_chunk_must_split_over_the_sequence_axis(tmp_path):
    r = _cli(tmp_path, "--mesh=sequence=2", "--prefill_chunk=15")
    assert r.returncode == 2, r.stderr[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert err[-1].endswith("--prefill_chunk 15 does not split over the mesh's sequence axis (2 devices): "
                            "pass a multiple of 2 (4 for balanced causal work)"), r.stderr[-2000:]


def test_cli_tensor_parallel_kv_cache(tmp_path):
    """``--mesh tensor=2`` with two kv heads: the engine's cache is sharded by kv head and every prefill and
    decode step attends per device with its heads (recorded), the same output."""
    r = _cli(tmp_path, "--mesh=tensor=2", "--show_stats", num_heads=4, num_kv_heads=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--- generation ---\n" + "".join(H.GOOD_PIECES[:-1]) + "\n" in r.stdout
    assert "mesh_attention/gather=sequence=1,heads=tensor,order=-" in r.stderr
    assert "mesh_attention/paged=sequence=1,heads=tensor,order=-" in r.stderr
    assert "KV cache: sharded by kv head over tensor=2 (2 kv heads)" in r.stderr


def test_cli_says_when_the_kv_cache_cannot_shard(tmp_path):
    """``--mesh tensor=2`` over one kv head: the cache stays replicated, and the run says so (same output)."""
    r = _cli(tmp_path, "--mesh=tensor=2", "--show_stats")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--- generation ---\n" + "".join(H.GOOD_PIECES[:-1]) + "\n" in r.stdout
    assert ("KV cache: replicated on every device: tensor=2 does not divide the 1 kv heads and 2 heads "
            "(attention repeats on each device)") in r.stderr
    assert "mesh_attention/" not in r.stderr
