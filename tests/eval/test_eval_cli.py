"""Eval CLI and runtime adapter, with a stand-in inference runtime (``load_model_fns``'s ``factory``)."""

import functools
import json
import math
import os
import re
import sysconfig

import numpy as np
import pytest

from minimax_jax.data.tokenizer import save_tokenizer, train_tokenizer_from_paths
from minimax_jax.eval import cli, runner
from minimax_jax.eval.chat import chat_prompt, strip_thinking
from minimax_jax.eval.runner import RuntimeUnavailable, load_model_fns

STD = sysconfig.get_paths()["stdlib"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer_from_paths([os.path.join(STD, "json", "*.py")], 600), str(d))
    return str(d)


def reader(prompt):
    """A stand-in model that really reads the prompt (passkey / codes / variable chains)."""
    if "secret passkey" in prompt:
        return " " + re.search(r"The secret passkey is (\d+)\.", prompt).group(1) + "."
    m = re.search(r"special code for ([\w-]+) in the text above", prompt)
    if m:
        return " " + re.search(rf"special code for {m.group(1)} is (\d+)\.", prompt).group(1)
    m = re.search(r"assigned the value (\d+), directly", prompt)
    if m:
        values = {}
        for name, rhs in re.findall(r"^VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.$", prompt, flags=re.M):
            values[name] = values[rhs[4:]] if rhs.startswith("VAR") else rhs
        return " " + ", ".join(k for k, v in values.items() if v == m.group(1))
    return " I do not know."


def install_fake_infer(monkeypatch, tok_dir, answer, calls):
    """The eval CLI runs against a fake inference runtime (``load_model_fns``'s ``factory``)."""

    def make_eval_fns(checkpoint, **options):
        calls.append((checkpoint, options))

        def generate_fn(prompts, max_new_tokens):
            return [answer(p) for p in prompts]

        def logprob_fn(tokens):
            return np.full((tokens.shape[0], tokens.shape[1] - 1), -math.log(600.0))

        return {"generate_fn": generate_fn, "logprob_fn": logprob_fn, "tokenizer": tok_dir}

    monkeypatch.setattr(cli, "load_model_fns", functools.partial(runner.load_model_fns, factory=make_eval_fns))


def args(tmp_path, *extra):
    ppl = tmp_path / "heldout.txt"
    ppl.write_text(open(os.path.join(STD, "json", "encoder.py")).read())
    return ["--checkpoint", "ckpt", "--tasks", "niah_single,niah_multikey,variable_tracking",
            "--lengths", "700,1200", "--num_samples", "2", "--haystack", "noise",
            "--ppl_files", str(ppl), "--ppl_seq_len", "128", "--ppl_batch_size", "3",
            "--out", str(tmp_path / "r.json"),
            *extra]


def test_cli_scores_a_reading_model_perfectly(monkeypatch, tmp_path, tok_dir, capsys):
    calls = []
    install_fake_infer(monkeypatch, tok_dir, reader, calls)
    assert cli.main(args(tmp_path, "--max_seq_len", "4096", "--tokenizer", tok_dir)) == 0
    assert calls == [("ckpt", {"max_seq_len": 4096, "tokenizer_path": tok_dir})]
    r = json.load(open(tmp_path / "r.json"))
    assert r["mean"] == 1.0 and len(r["examples"]) == 12
    assert r["tasks"]["variable_tracking"] == {"700": 1.0, "1200": 1.0}
    assert r["perplexity"]["perplexity"] == pytest.approx(600.0)
    assert "niah_single" in capsys.readouterr().out


def test_attention_dense_is_forwarded_and_recorded(monkeypatch, tmp_path, tok_dir):
    """--attention dense reaches the runtime's loader (MSA layers as full attention) and the results say
    which attention ran; the default forwards nothing and records as_trained."""
    calls = []
    install_fake_infer(monkeypatch, tok_dir, reader, calls)
    assert cli.main(args(tmp_path, "--no_perplexity", "--attention", "dense")) == 0
    assert calls[-1] == ("ckpt", {"attention": "dense"})
    assert json.load(open(tmp_path / "r.json"))["attention"] == "dense"
    assert cli.main(args(tmp_path, "--no_perplexity")) == 2                 # r.json exists: refused
    assert cli.main(args(tmp_path, "--no_perplexity", "--overwrite")) == 0
    assert calls[-1] == ("ckpt", {})
    assert json.load(open(tmp_path / "r.json"))["attention"] == "as_trained"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--checkpoint", "c", "--attention", "sparse"])


def test_cli_scores_a_guessing_model_zero(monkeypatch, tmp_path, tok_dir):
    install_fake_infer(monkeypatch, tok_dir, lambda p: " 1234.", [])
    cli.main(args(tmp_path, "--no_perplexity"))
    r = json.load(open(tmp_path / "r.json"))
    assert r["mean"] == 0.0 and "perplexity" not in r


def test_chat_mode_wraps_and_strips(monkeypatch, tmp_path, tok_dir):
    seen = []

    def answer(p):
        seen.append(p)
        return "let me look...\n</think>\n\n" + reader(p) + "[e~["

    install_fake_infer(monkeypatch, tok_dir, answer, [])
    cli.main(args(tmp_path, "--chat", "--no_perplexity"))
    assert all(p.startswith("]~!b[]~b]user\n") and p.endswith("]~b]ai\n<think>\n") for p in seen)
    assert json.load(open(tmp_path / "r.json"))["mean"] == 1.0


def test_chat_helpers():
    assert chat_prompt("hi", system="s") == "]~!b[]~b]system\ns[e~[\n]~b]user\nhi[e~[\n]~b]ai\n<think>\n"
    assert strip_thinking("reason</think>\n\nanswer 5[e~[junk") == "answer 5"
    assert strip_thinking("<think>a</think>b") == "b"
    assert strip_thinking("plain") == "plain"


def test_runtime_that_breaks_the_contract_is_a_clear_error():
    with pytest.raises(RuntimeUnavailable, match="is not a function"):
        load_model_fns("ckpt", factory=None)
    with pytest.raises(RuntimeUnavailable, match="must return a mapping"):
        load_model_fns("ckpt", factory=lambda ckpt, **kw: [ckpt])
    seen = {}

    def factory(ckpt, **kw):
        seen.update(kw, ckpt=ckpt)
        return {"generate_fn": None}
    with pytest.raises(RuntimeUnavailable, match="no callable 'generate_fn'"):
        load_model_fns("ckpt", tokenizer="tok.json", factory=factory, max_seq_len=7)
    assert seen == {"ckpt": "ckpt", "tokenizer_path": "tok.json", "max_seq_len": 7}


def test_bad_runtime_result_and_bad_args(tmp_path, tok_dir):
    with pytest.raises(RuntimeUnavailable, match="no callable 'generate_fn'"):
        load_model_fns("ckpt", factory=lambda ckpt, **kw: {"generate_fn": None, "tokenizer": tok_dir})
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--checkpoint", "c", "--tasks", "nope"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--checkpoint", "c", "--lengths", "12,x"])


def test_time_budget_skips_longest_and_writes_partial(tmp_path, tok_dir):
    """A zero budget still runs the first batch (shortest prompts), skips the rest, writes them."""
    from minimax_jax.data.tokenizer import load_tokenizer
    from minimax_jax.eval.runner import ModelFns

    tok = load_tokenizer(tok_dir)
    calls = []

    def generate_fn(prompts, max_new_tokens):
        calls.append(len(prompts))
        return [" 0." for _ in prompts]

    out = tmp_path / "r.json"
    rc = cli.main(["--checkpoint", "unused", "--tasks", "niah_single", "--lengths", "300,200", "--num_samples", "2",
                   "--batch_size", "2", "--haystack", "noise", "--no_perplexity", "--time_budget_s", "0",
                   "--out", str(out)], fns=ModelFns(generate_fn, None, tok))
    assert rc == 0 and calls == [2]
    r = json.loads(out.read_text())
    assert [e["target_length"] for e in r["examples"]] == [200, 200]
    assert r["skipped"] == [{"task": "niah_single", "target_length": 300}] * 2
    assert r["timing"][0]["prompts"] == 2 and r["timing"][0]["seconds"] >= 0


@pytest.mark.parametrize("flags,starts_with_bos", [([], True), (["--no_bos"], False), (["--chat"], True)])
def test_raw_prompts_start_with_bos_like_training_documents(tmp_path, tok_dir, flags, starts_with_bos):
    """The training pipeline starts every document with ]~!b[; raw eval prompts do too (unless --no_bos)."""
    from minimax_jax.chat.tokens import BOS
    from minimax_jax.data.tokenizer import load_tokenizer
    from minimax_jax.eval.runner import ModelFns

    tok = load_tokenizer(tok_dir)
    assert tok.token_to_id(BOS) is not None
    seen = []

    def generate_fn(prompts, max_new_tokens):
        seen.extend(prompts)
        return [" 0." for _ in prompts]

    rc = cli.main(["--checkpoint", "unused", "--tasks", "niah_single", "--lengths", "200", "--num_samples", "2",
                   "--haystack", "noise", "--no_perplexity", "--out", str(tmp_path / "r.json"), *flags],
                  fns=ModelFns(generate_fn, None, tok))
    assert rc == 0 and len(seen) == 2
    assert all(p.startswith(BOS) == starts_with_bos and not p.startswith(BOS + BOS) for p in seen)  # chat: its own
    if not flags:   # the BOS is one token, then the prompt exactly as generated
        assert all(tok.encode(p, add_special_tokens=False).ids[0] == tok.token_to_id(BOS) for p in seen)


def _config_only_checkpoint(tmp_path, tok_dir, context):
    """A checkpoint directory as far as the up-front checks read it: config.yaml, params/, tokenizer."""
    import shutil

    import yaml

    from minimax_jax.config import ModelConfig

    d = tmp_path / "ckpt"
    (d / "params").mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(ModelConfig(max_position_embeddings=context).to_dict()))
    shutil.copy(os.path.join(tok_dir, "tokenizer.json"), d / "tokenizer.json")
    return str(d)


def test_lengths_over_the_context_fail_before_prompts_or_params(monkeypatch, tmp_path, tok_dir, capsys):
    """--lengths (+ BOS / chat wrapper + --max_new_tokens) over the checkpoint's context, or a
    --ppl_seq_len / --max_seq_len over it: one line, exit 2, before any prompt is built or any
    parameter is loaded; a length that fits goes on to loading."""
    ckpt = _config_only_checkpoint(tmp_path, tok_dir, 4096)

    def never(*a, **k):
        raise AssertionError("must not be reached")

    monkeypatch.setattr(cli, "generate_suite", never)
    monkeypatch.setattr(cli, "load_model_fns", never)
    base = ["--checkpoint", ckpt, "--tasks", "niah_single", "--num_samples", "1", "--ppl_seq_len", "128"]
    for extra, needles in [
        (["--lengths", "1000,2000000"], ["--lengths 2000000", "+ --max_new_tokens 48", "exceeds the context of",
                                         "(4096 tokens, max_position_embeddings); use --lengths of at most 40"]),
        (["--lengths", "4090", "--chat"], ["chat-format tokens + --max_new_tokens 48"]),
        (["--lengths", "4000", "--max_new_tokens", "5000"],
         ["--max_new_tokens alone leaves no room for a prompt: lower it to at most 9"]),
        (["--lengths", "1000", "--ppl_seq_len", "8192"], ["--ppl_seq_len 8192 exceeds the context", "--no_perplexity"]),
        (["--lengths", "1000", "--max_seq_len", "8192"], ["--max_seq_len 8192 exceeds the context"]),
    ]:
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m minimax_jax.eval: error: ") and err.count("\n") == 1, err
        for n in needles:
            assert n in err, (n, err)
        assert "at most 0" not in err

    def stop(*a, **k):
        raise RuntimeUnavailable("reached loading")

    monkeypatch.setattr(cli, "load_model_fns", stop)
    assert cli.main(base + ["--lengths", "4000"]) == 2       # 4000 + BOS + 48 fits in 4096
    assert capsys.readouterr().err.splitlines()[-1] == "python -m minimax_jax.eval: error: reached loading"


def test_context_too_long_from_the_runtime_is_one_line(tmp_path, tok_dir, capsys):
    from minimax_jax.data.tokenizer import load_tokenizer
    from minimax_jax.infer.errors import ContextTooLong

    def gen(prompts, n):
        raise ContextTooLong("the prompt has 9 tokens; ... shorten the prompt by 1 tokens")

    fns = cli.ModelFns(gen, None, load_tokenizer(tok_dir))
    code = cli.main(["--checkpoint", "x", "--tasks", "niah_single", "--lengths", "300", "--num_samples", "1",
                     "--haystack", "noise", "--no_perplexity"], fns=fns)
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "python -m minimax_jax.eval: error: the prompt has 9 tokens; ... shorten the prompt by 1 tokens"


def test_intervals_and_perplexity_by_position(monkeypatch, tmp_path, tok_dir, capsys):
    """Each task x length cell carries its prompt count and a 95 % Wilson interval around its mean; the
    perplexity comes per bucket of window position (the --ppl_buckets edges), the buckets' tokens adding up;
    bad bucket edges are a one-line usage error before anything loads."""
    from minimax_jax.eval.scoring import wilson_interval

    calls = []
    install_fake_infer(monkeypatch, tok_dir, reader, calls)
    assert cli.main(args(tmp_path, "--ppl_buckets", "16,64")) == 0
    r = json.load(open(tmp_path / "r.json"))
    assert r["counts"]["niah_single"] == {"700": 2, "1200": 2}
    lo, hi = r["intervals"]["niah_single"]["700"]
    assert (lo, hi) == pytest.approx(wilson_interval(1.0, 2)) and 0.0 < lo < 1.0 == hi
    byp = r["perplexity"]["by_position"]
    assert [(b["lo"], b["hi"]) for b in byp] == [(0, 16), (16, 64), (64, 128)]
    assert sum(b["tokens"] for b in byp) == r["perplexity"]["tokens"]
    assert all(b["perplexity"] == pytest.approx(600.0) for b in byp)
    out = capsys.readouterr().out
    assert "n=2" in out and "perplexity by position: [0, 16)" in out
    n_calls = len(calls)
    for bad in ("64,16", "16,128", "16,16"):
        assert cli.main(args(tmp_path, "--ppl_buckets", bad)) == 2
        err = capsys.readouterr().err
        assert "--ppl_buckets" in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as e:                 # not a positive integer: argparse's usage error
        cli.main(args(tmp_path, "--ppl_buckets", "0,64"))
    assert e.value.code == 2 and "--ppl_buckets" in capsys.readouterr().err
    assert len(calls) == n_calls                       # refused before loading the checkpoint


@pytest.mark.parametrize("text, seq_len", [("\n", "128"), ("hi", "64"), ("hi there " * 20, "128")])
def test_ppl_files_too_short_for_one_window_are_refused(monkeypatch, tmp_path, tok_dir, capsys, text, seq_len):
    """--ppl_files holding fewer tokens than one --ppl_seq_len window + 1: bad input (exit 2), one line naming
    the file and its token count, no perplexity reported; enough text is scored."""
    install_fake_infer(monkeypatch, tok_dir, reader, [])
    short = tmp_path / "short.txt"
    short.write_text(text)
    argv = ["--checkpoint", "ckpt", "--tasks", "niah_single", "--lengths", "700", "--num_samples", "1",
            "--haystack", "noise", "--ppl_files", str(short), "--ppl_seq_len", seq_len]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = [ln for ln in captured.err.splitlines() if "error" in ln]
    assert len(err) == 1 and f"--ppl_files '{short}': " in err[0], captured.err
    assert f"need at least {int(seq_len) + 1} for one window of --ppl_seq_len {seq_len}" in err[0], err
    assert "perplexity" not in captured.out
    short.write_text(open(os.path.join(STD, "json", "encoder.py")).read())
    assert cli.main(argv) == 0
    assert "held-out perplexity" in capsys.readouterr().out
