"""``python infer.py`` in a subprocess: chat rendering -> paged engine -> streamed text -> tool calls as
JSON, malformed tool-call output reported, and the cheap error paths (exit status 1, one message)."""

from tests.paths import REPO_ROOT
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests import infer_helpers as H

ROOT = REPO_ROOT


def _run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "infer.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _parsed(stdout: str) -> dict:
    marker = "--- parsed output (JSON) ---"
    assert marker in stdout, stdout
    return json.loads(stdout.split(marker, 1)[1])


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    return H.chain_checkpoint(str(tmp_path_factory.mktemp("good") / "ckpt"), H.GOOD_PIECES)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("chat") / "chat.json"
    p.write_text(json.dumps(H.CHAT))
    return str(p)


def test_chat_tool_call_streamed_and_parsed(good_ckpt, chat_file):
    r = _run(f"--checkpoint={good_ckpt}", f"--chat_file={chat_file}", "--temperature=0", "--stream",
             "--prefill_chunk=128")
    assert r.returncode == 0, r.stderr[-3000:]
    expected_text = "".join(H.GOOD_PIECES[:-1])  # the end-of-turn token is a stop token, not text
    assert r.stdout.startswith(expected_text + "\n"), r.stdout
    parsed = _parsed(r.stdout)
    assert parsed["reasoning"] == "Let me check."
    assert parsed["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert parsed["errors"] == []
    assert "engine: paged (DecodeEngine" in r.stderr          # the run says which engine ran
    assert "stopped: stop_token" in r.stderr
    assert "TTFT" in r.stderr and "tok/s" in r.stderr
    assert "prefill" in r.stderr                               # progress bar: prompt > one chunk


def test_malformed_tool_call_is_reported_not_fatal(tmp_path, chat_file):
    ckpt = H.chain_checkpoint(str(tmp_path / "ckpt"), H.BAD_PIECES)
    r = _run(f"--checkpoint={ckpt}", f"--chat_file={chat_file}", "--temperature=0", "--engine=recompute")
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = _parsed(r.stdout)
    assert parsed["tool_calls"] == []
    assert [e["kind"] for e in parsed["errors"]] == ["unclosed_parameter"]
    assert "warning: malformed tool call output (unclosed_parameter)" in r.stderr
    assert "engine: recompute" in r.stderr


def test_errors_exit_1_with_a_message(tmp_path, good_ckpt):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(good_ckpt, ckpt)
    os.remove(os.path.join(ckpt, "tokenizer.json"))
    r = _run(f"--checkpoint={ckpt}", "--prompt=hi")
    assert r.returncode == 1
    assert f"error: no tokenizer: looked for {os.path.join(ckpt, 'tokenizer.json')}" in r.stderr

    r = _run(f"--checkpoint={tmp_path / 'nowhere'}", "--prompt=hi")
    assert r.returncode == 1 and "does not exist" in r.stderr

    r = _run(f"--checkpoint={ckpt}")
    assert r.returncode == 1 and "give exactly one of --prompt, --prompt_file, --chat_file" in r.stderr


def test_context_too_long_fails_before_loading(tmp_path, good_ckpt):
    ckpt = good_ckpt
    ctx = tmp_path / "book.txt"
    ctx.write_text("The weather in Paris is mild. " * 400)
    r = _run(f"--checkpoint={ckpt}", f"--context_file={ctx}", "--prompt=Where?", "--max_new_tokens=100")
    assert r.returncode == 1
    assert "> the model's context of 2048 tokens" in r.stderr
    assert "model:" not in r.stderr    # parameters were never loaded


def test_bad_dtype_and_unreadable_chat_file_are_flag_errors(tmp_path):
    """--dtype takes only the dtypes loading supports (a clean flag error, no traceback); a missing
    --chat_file is named like a missing --prompt_file."""
    for bad in ("foo", "float8_e4m3fn", "float16"):
        r = _run(f"--dtype={bad}", "--prompt=hi", timeout=60)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert f"flag --dtype={bad}: value should be one of <float32|bfloat16>" in r.stderr
        assert "kv_dtype" not in r.stderr
    missing = str(tmp_path / "missing.json")
    r = _run(f"--chat_file={missing}", timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == f"error: cannot read --chat_file {missing!r}: No such file or directory"
