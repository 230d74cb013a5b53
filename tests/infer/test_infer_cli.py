"""``python infer.py`` in a subprocess: chat rendering -> paged engine -> streamed text -> tool calls as
JSON (or nothing but JSON with ``--json``), malformed tool-call output reported, Ctrl-C, the cheap error
paths (exit status 1 or 2, one message; all but one through ``minimax_jax.infer.cli.main`` in this process, which
is all infer.py runs); the throughput numbers with compilation apart."""

from tests.paths import REPO_ROOT
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from minimax_jax.chat import render_chat
from minimax_jax.infer.metrics import CompileClock, GenerationStats, combine_stats, merged_seconds
from tests import infer_helpers as H

ROOT = REPO_ROOT


def _run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "infer.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _in_process(capsys, *args) -> tuple[int, str]:
    """``infer.py ARGS`` run in this process (``minimax_jax.infer.cli.main``, all that infer.py calls; no
    interpreter start-up): ``(exit status, stderr)``. For the error paths that fail before generating."""
    from minimax_jax.infer import cli

    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as e:          # argparse's usage errors (exit status 2) pass through cli_main.run
        code = e.code
    return code, capsys.readouterr().err


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


def test_greedy_default_runs_device_loops(good_ckpt, chat_file):
    """Greedy decoding by default: 16 steps per device loop (--decode_loop auto), the same text as one step at a
    time, and the run summary says so."""
    r = _run(f"--checkpoint={good_ckpt}", f"--chat_file={chat_file}", "--temperature=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("--- generation ---\n", 1)[1].startswith("".join(H.GOOD_PIECES[:-1]))
    assert "(device loops of 16 steps)" in r.stderr and "stopped: eos" in r.stderr


def test_chat_tool_call_streamed_and_parsed(good_ckpt, chat_file):
    # --decode_loop 1: one step per round trip, so that steps after the first compile nothing (greedy decoding
    # would otherwise run in one 16-step device loop here: test_greedy_default_runs_device_loops)
    r = _run(f"--checkpoint={good_ckpt}", f"--chat_file={chat_file}", "--temperature=0", "--stream",
             "--prefill_chunk=128", "--decode_loop=1")
    assert r.returncode == 0, r.stderr[-3000:]
    expected_text = "".join(H.GOOD_PIECES[:-1])  # the end-of-turn token is a stop token, not text
    prompt = render_chat(H.CHAT["messages"], H.CHAT["tools"])
    assert r.stdout.startswith(f"--- prompt ---\n{prompt}\n--- generation ---\n{expected_text}\n"), r.stdout
    parsed = _parsed(r.stdout)
    assert parsed["reasoning"] == "Let me check."
    assert parsed["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert parsed["errors"] == []
    assert r.stderr.count("engine: paged (DecodeEngine") == 1     # which engine ran, said once
    engine_line = next(x for x in r.stderr.splitlines() if "engine: paged" in x)
    assert engine_line.startswith("engine: paged")                 # its own line, not inside the bar
    assert "stopped: eos" in r.stderr
    assert "TTFT" in r.stderr and "tok/s steady state (excl." in r.stderr and "compiled in" in r.stderr
    assert "prefill: " in r.stderr                                 # progress bar: prompt > one chunk


def test_chat_json_is_all_there_is_on_stdout(good_ckpt, chat_file):
    r = _run(f"--checkpoint={good_ckpt}", f"--chat_file={chat_file}", "--temperature=0", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.splitlines()                             # one record, nothing else
    rec = json.loads(line)
    assert rec["parsed"]["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert (rec["id"], rec["sample"], rec["stop_reason"], rec["text"]) == (0, 0, "eos", "".join(H.GOOD_PIECES[:-1]))
    assert "engine: paged" in r.stderr and "stopped: eos" in r.stderr


def test_ctrl_c_during_generation_exits_130_with_one_line(tmp_path):
    ckpt = H.chain_checkpoint(str(tmp_path / "cycle"), H.GOOD_PIECES[:-1], cycle=True)   # never ends by itself
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "infer.py"), f"--checkpoint={ckpt}",
                          "--prompt=Let me check.", "--temperature=0", "--stream", "--max_new_tokens=2000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        head, deadline = b"", time.time() + 90
        while head.count(b"</think>") < 2 and time.time() < deadline:    # generating: the cycle came round
            chunk = p.stdout.read1(256)
            assert chunk, p.stderr.read().decode()[-3000:]
            head += chunk
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert [x for x in err.splitlines() if "interrupt" in x.lower()] == [
        "interrupted (Ctrl-C): 0 of 1 generations finished"]
    assert err.splitlines()[-1].startswith("interrupted (Ctrl-C)")
    assert "stopped:" not in err and (head + out).decode().startswith("--- prompt ---\n")


def test_malformed_tool_call_is_reported_not_fatal(tmp_path, chat_file):
    ckpt = H.chain_checkpoint(str(tmp_path / "ckpt"), H.BAD_PIECES)
    r = _run(f"--checkpoint={ckpt}", f"--chat_file={chat_file}", "--temperature=0", "--engine=recompute")
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = _parsed(r.stdout)
    assert parsed["tool_calls"] == []
    assert [e["kind"] for e in parsed["errors"]] == ["unclosed_parameter"]
    assert "warning: malformed tool call output (unclosed_parameter)" in r.stderr
    assert "engine: recompute" in r.stderr


def test_bad_input_exits_2_with_one_line(tmp_path, good_ckpt, capsys):
    """The first case through ``python infer.py`` (the script's exit status), the others in this process."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(good_ckpt, ckpt)
    os.remove(os.path.join(ckpt, "tokenizer.json"))
    r = _run(f"--checkpoint={ckpt}", "--prompt=hi")
    assert r.returncode == 2
    assert f"error: no tokenizer: looked for {os.path.join(ckpt, 'tokenizer.json')}" in r.stderr

    code, err = _in_process(capsys, f"--checkpoint={tmp_path / 'nowhere'}", "--prompt=hi")
    assert code == 2 and "does not exist" in err

    code, err = _in_process(capsys, f"--checkpoint={ckpt}")
    assert code == 2
    assert "give exactly one of --prompt, --prompt_file, --chat_file, --prompts_file" in err


def test_num_draft_beyond_the_models_mtp_modules_is_a_usage_error(capsys):
    """The shipped demo has one MTP module: --num_draft 2 is bad input (exit 2, one line), found once the
    checkpoint's config is known."""
    code, err = _in_process(capsys, "--prompt=hi", "--speculative=mtp", "--num_draft=2", "--temperature=0",
                            "--max_new_tokens=2")
    assert code == 2, err[-2000:]
    assert "error: --num_draft 2: this model has 1 MTP modules, so 1..1 drafts per step" in err


def test_context_too_long_fails_before_loading(tmp_path, good_ckpt, capsys):
    ckpt = good_ckpt
    ctx = tmp_path / "book.txt"
    ctx.write_text("The weather in Paris is mild. " * 400)
    code, err = _in_process(capsys, f"--checkpoint={ckpt}", f"--context_file={ctx}", "--prompt=Where?",
                            "--max_new_tokens=100")
    assert code == 2
    assert "> the model's context of 2048 tokens" in err
    assert "model:" not in err    # parameters were never loaded


def test_bad_dtype_and_unreadable_chat_file_are_flag_errors(tmp_path, capsys):
    """--dtype takes only the dtypes loading supports (a clean flag error, no traceback); a missing
    --chat_file is named like a missing --prompt_file. (In this process: argparse's and cli_main's messages.)"""
    for bad in ("foo", "float8_e4m3fn", "float16"):
        code, err = _in_process(capsys, f"--dtype={bad}", "--prompt=hi")
        assert code != 0 and "Traceback" not in err, err[-2000:]
        assert code == 2 and f"argument --dtype: invalid choice: '{bad}'" in err
        assert "kv_dtype" not in err
    missing = str(tmp_path / "missing.json")
    code, err = _in_process(capsys, f"--chat_file={missing}")
    assert code == 2
    assert err.strip().splitlines()[-1] == f"infer.py: error: cannot read --chat_file {missing!r}: No such file or directory"


def test_flag_combinations_that_cannot_work_exit_2(capsys):
    from minimax_jax.infer import cli

    for args, msg in [(("--json", "--stream"), "--stream prints text as it comes"),
                      (("--json", "--output=x.jsonl"), "pick one"),
                      (("--logprobs",), "--logprobs adds log-probabilities to the JSON records"),
                      (("--overwrite",), "--overwrite applies only with --output"),
                      (("--num_draft=2",), "--num_draft needs --speculative mtp"),
                      (("--mtp_window=5",), "--mtp_window needs --speculative mtp"),
                      (("--speculative=mtp", "--mtp_window=8193"), "mtp_window must be an int in [1, 8192], got 8193")]:
        code = cli.main(["--prompt=hi", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("infer.py: error: ") and msg in err, (args, err)


def test_steady_state_throughput_excludes_compiling_steps():
    """Fake timings: 2 steps that compiled (3 s, 1.5 s) and 8 steps of 0.1 s with 4 tokens each."""
    st = GenerationStats(batch=4, prompt_tokens=20, generated_tokens=44, prefill_s=5.0, prefill_compile_s=4.1,
                         ttft_s=5.1, decode_s=5.3, decode_steps=10)
    st.add_step(3.0, 4, True)
    for _ in range(8):
        st.add_step(0.1, 4, False)
    st.add_step(1.5, 4, True)
    assert st.steady_tokens == 32 and st.compile_steps == 2
    assert st.steady_tokens_per_s == pytest.approx(32 / 0.8)
    assert st.decode_compile_s == pytest.approx(4.5)
    assert st.tokens_per_s == pytest.approx(43 / 5.3)              # the all-in number, for comparison
    line = st.summary()
    assert "prefill 5.00s (compiled in 4.10s)" in line
    assert "decode 40.0 tok/s steady state (excl. 4.50s compile in 2 of 10 steps)" in line
    assert "engine" not in line                                    # printed once, when the engine is built
    only = GenerationStats(decode_steps=1)
    only.add_step(2.0, 1, True)
    only.generated_tokens, only.decode_s = 5, 2.0                  # no steady step: the all-in rate, said so
    assert only.steady_tokens_per_s is None
    assert "decode 2.0 tok/s with compilation (no steady state: every decode step compiled)" in only.summary()
    both = combine_stats([st, st])
    assert (both.steady_tokens, both.compile_steps, both.ttft_s) == (64, 4, 5.1)
    assert both.steady_tokens_per_s == pytest.approx(40.0)


def test_compile_clock_measures_compilation():
    import jax
    import jax.numpy as jnp

    assert merged_seconds([(0, 2), (1, 3), (5, 6), (10, 20)], 0.5, 12) == pytest.approx(2.5 + 1 + 2)
    clock = CompileClock()
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
    x = jnp.arange(7.0)
    t0 = clock.now()
    jax.block_until_ready(f(x))
    first = clock.since(t0)
    t1 = clock.now()
    jax.block_until_ready(f(x))
    assert first > 0 and clock.since(t1) == 0.0


def test_should_stop_ends_generation_between_steps_and_prefill_chunks():
    """What Ctrl-C sets (``InterruptFlag``) is checked before prefill, after each prefill chunk and
    between decode steps; an engine stopped mid-prefill is not reused."""
    from minimax_jax.infer import GenerationConfig, Generator

    tok = H.chain_tokenizer(H.GOOD_PIECES)
    start = H.chat_prompt_ids(tok)[-1]
    cfg, params = H.chain_model(tok, H.GOOD_PIECES[:-1], start, cycle=True)
    g = Generator(cfg, params, tok, engine_options={"prefill_chunk": 16})
    config = GenerationConfig(max_new_tokens=50, stop_token_ids=())

    def after(k):
        calls = []
        return lambda: len(calls.append(1) or calls) > k

    out = g.generate([[start]], config, should_stop=after(6))     # start, 1 chunk, 4 steps, stop
    (s,) = out.sequences
    assert out.interrupted and s.stop_reason == "interrupted" and len(s.tokens) == 5
    long = [9] * 39 + [start]                                      # 3 chunks of 16
    out = g.generate([long, [start]], config, should_stop=after(2))
    assert out.interrupted and [x.tokens for x in out.sequences] == [[], []] and g.backend is None
    full = g.generate([long, [start]], config).sequences
    fresh = Generator(cfg, params, tok, engine_options={"prefill_chunk": 16}).generate([long, [start]], config)
    assert [x.tokens for x in full] == [x.tokens for x in fresh.sequences] and len(full[0].tokens) == 50
    assert full[0].tokens[:5] == s.tokens
