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
