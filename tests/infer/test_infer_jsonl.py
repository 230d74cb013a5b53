"""``infer.py --prompts_file`` (JSONL in, JSONL records out), ``--n`` samples, ``--logprobs``, ``--output``,
the text layout and the prompts-file errors; the CLI runs in this process (flags parsed, ``cli.run``)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from minimax_jax.infer import cli
from minimax_jax.infer.prompts_io import RECORD_KEYS, read_prompts_file
from minimax_jax.infer.sampler import token_logprobs
from minimax_jax.model import abstract_params, forward
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")

LINES = [{"prompt": "The weather in Paris", "id": "w"},
         {"prompt": "Let me check", "max_new_tokens": 4},
         {"messages": [{"role": "user", "content": "What is the weather?"}], "id": "chat"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A one-layer random-weight checkpoint (its greedy continuations differ from prompt to prompt)."""
    from minimax_jax.data.tokenizer import special_token_ids

    tok = H.tiny_tokenizer()
    sp = special_token_ids(tok)
    cfg = H.tiny_config(tok.get_vocab_size(), eos_token_id=sp["eos_token_id"], bos_token_id=sp["bos_token_id"],
                        pad_token_id=sp["pad_token_id"])
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype), abstract_params(cfg))
    d = H.save_checkpoint(str(tmp_path_factory.mktemp("rand") / "ckpt"), cfg, params, tok)
    prompts = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in LINES[:2]) + "\n\n" + json.dumps(LINES[2]) + "\n")
    chat = tmp_path_factory.mktemp("c") / "chat.json"
    chat.write_text(json.dumps({"messages": LINES[2]["messages"]}))
    return d, str(prompts), str(chat), cfg, jax.tree.map(jnp.asarray, params), tok


@pytest.fixture
def infer(capsys):
    def go(*args):
        cli.parse(list(args))
        code = cli.run()
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    yield go


def _records(stdout: str) -> list:
    lines = stdout.splitlines()
    assert lines and all(line.startswith("{") for line in lines), stdout[:500]
    return [json.loads(line) for line in lines]


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in ("id", "index")}


def test_three_prompts_two_samples_greedy_equal_single_runs(model, infer):
    ckpt, prompts, chat, cfg, params, tok = model
    common = (f"--checkpoint={ckpt}", "--temperature=0", "--max_new_tokens=6", "--json", "--logprobs")
    code, out, err = infer(f"--prompts_file={prompts}", "--n=2", *common)
    assert code == 0, err
    recs = _records(out)
    assert [(r["id"], r["index"], r["sample"]) for r in recs] == [
        ("w", 0, 0), ("w", 0, 1), (1, 1, 0), (1, 1, 1), ("chat", 2, 0), ("chat", 2, 1)]
    for r in recs:
        assert set(r) == set(RECORD_KEYS) | {"logprobs"} | ({"parsed"} if r["id"] == "chat" else set())
        assert r["stop_reason"] in ("eos", "max_tokens", "stop_string", "repetition")
        assert len(r["logprobs"]) == len(r["tokens"])
        # random bytes: an unfinished UTF-8 sequence at the end is held back
        assert r["text"] == tok.decode(r["tokens"], skip_special_tokens=False).rstrip("\ufffd")
    assert [len(r["tokens"]) for r in recs[2:4]] == [4, 4]        # the line's own max_new_tokens
    assert recs[0] == {**recs[1], "sample": 0}                      # greedy: both samples the same
    assert len({tuple(r["tokens"]) for r in recs[::2]}) == 3        # ...and the prompts differ
    assert "warning: --n 2 with --temperature 0" in err
    singles = [("--prompt=The weather in Paris",), ("--prompt=Let me check", "--max_new_tokens=4"),
               (f"--chat_file={chat}",)]
    for k, extra in enumerate(singles):
        code, out1, _ = infer(*common, *extra)
        assert code == 0
        (one,) = _records(out1)
        # same tokens, text and stop; logprobs to float32 rounding (XLA's kernels depend on the batch shape)
        want = _strip(recs[2 * k])
        np.testing.assert_allclose(one.pop("logprobs"), want.pop("logprobs"), rtol=1e-5, atol=1e-6)
        assert _strip(one) == want, k
    # logprobs: the model's own log-softmax at each generated position (full forward reference)
    for r in recs[:4:2]:
        text = LINES[r["index"]]["prompt"]
        ids = tok.encode(text, add_special_tokens=False).ids
        seq = ids + r["tokens"]
        logits = np.asarray(forward(params, cfg, jnp.asarray([seq])).logits)[0]
        ref = jax.nn.log_softmax(jnp.asarray(logits), -1)
        want = [float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(r["tokens"])]
        np.testing.assert_allclose(r["logprobs"], want, rtol=1e-4, atol=1e-4)


def test_samples_are_seeded_and_batch_independent(model, infer):
    ckpt, prompts, *_ = model
    common = (f"--checkpoint={ckpt}", "--temperature=1.5", "--top_k=0", "--top_p=1", "--max_new_tokens=8",
              "--json", "--n=2")
    a = _records(infer(f"--prompts_file={prompts}", "--seed=3", *common)[1])
    assert a == _records(infer(f"--prompts_file={prompts}", "--seed=3", *common)[1])
    assert a != _records(infer(f"--prompts_file={prompts}", "--seed=4", *common)[1])
    assert a[0]["tokens"] != a[1]["tokens"]                 # two samples of one prompt differ
    alone = _records(infer("--prompt=The weather in Paris", "--seed=3", *common)[1])
    assert [_strip(r) for r in alone] == [_strip(r) for r in a[:2]]


def test_output_file_and_text_layout(model, infer, tmp_path):
    ckpt, prompts, *_ = model
    dst = tmp_path / "out.jsonl"
    args = (f"--checkpoint={ckpt}", f"--prompts_file={prompts}", "--temperature=0", "--max_new_tokens=3",
            f"--output={dst}", "--batch_size=2")
    code, out, err = infer(*args)
    assert code == 0
    recs = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["w", 1, "chat"]
    assert out.startswith("--- prompt 1/3 (id: w) ---\nThe weather in Paris\n--- generation 1/3 (id: w) ---\n"
                          + recs[0]["text"] + "\n--- prompt 2/3 ---\nLet me check\n"), out
    assert "--- parsed output (JSON) ---" in out
    assert err.count("engine: paged") == 1 and "stopped: " in err
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        infer(*args)
    assert infer(*args, "--overwrite")[0] == 0
    with pytest.raises(ValueError, match="is the input file"):
        infer(*args[:-2], f"--output={prompts}", "--overwrite")
    assert read_prompts_file(prompts)[0].id == "w"               # the input is untouched


@pytest.mark.parametrize("line, match", [
    ("{not json", "not valid JSON"), ('{"prompt": "a", "max_tokens": 3}', r"unknown keys \['max_tokens'\]"),
    ('{"prompt": "a", "messages": []}', "exactly one of 'prompt'"), ('{"id": 1}', "exactly one of 'prompt'"),
    ('{"prompt": "a", "max_new_tokens": 0}', "'max_new_tokens' must be an integer >= 1"),
    ('{"prompt": "a", "id": [1]}', "'id' must be a string or an integer"), ('["a"]', "expected a JSON object"),
    ('{"messages": [{"role": "nobody", "content": "x"}]}', "role"),
    ('{"prompt": "a", "tools": []}', "go with 'messages'"),
    ('{"prompt": "bad \\ud800 x"}', "lone UTF-16 surrogate"),
])
def test_prompts_file_errors_name_the_line(tmp_path, line, match):
    from minimax_jax.chat import ChatFormatError

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises((ValueError, ChatFormatError), match=match) as e:
        read_prompts_file(str(f))
    assert f"{f}:2" in str(e.value)


def test_prompts_file_whole_file_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    with pytest.raises(ValueError, match="id 'x' repeats the one on line 1"):
        read_prompts_file(str(f))
    f.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts_file(str(f))
    with pytest.raises(ValueError, match="cannot read --prompts_file"):
        read_prompts_file(str(tmp_path / "missing.jsonl"))


def test_token_logprobs_is_log_softmax():
    x = np.random.default_rng(0).standard_normal((3, 11)).astype(np.float32) * 4
    t = [0, 5, 10]
    want = np.log(np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum(-1, keepdims=True))[range(3), t]
    np.testing.assert_allclose(token_logprobs(x, t), want, rtol=1e-12)


def test_replacing_an_output_keeps_the_old_file_until_the_run_is_whole(tmp_path):
    """--overwrite: records go to <path>.partial and replace the old file only when the run completes; an
    interrupted (or failed) run keeps the old file, and its records so far in <path>.partial (none: removed)."""
    from minimax_jax.infer.prompts_io import RecordWriter
    path = tmp_path / "o.jsonl"
    path.write_text('{"old": 1}\n')
    for complete, records in ((False, 0), (False, 1), (True, 2)):
        w = RecordWriter(str(path), overwrite=True)
        assert w.where == str(path) + ".partial"
        for i in range(records):
            w.write({"new": i})
        w.close(complete)
        if complete:
            assert [json.loads(x) for x in path.read_text().splitlines()] == [{"new": 0}, {"new": 1}]
            assert w.where == str(path) and sorted(os.listdir(tmp_path)) == ["o.jsonl"]
        else:
            assert path.read_text() == '{"old": 1}\n'
            assert sorted(os.listdir(tmp_path)) == (["o.jsonl", "o.jsonl.partial"] if records else ["o.jsonl"])
    fresh = RecordWriter(str(tmp_path / "new.jsonl"))                 # a new file is written in place
    assert fresh.where == str(tmp_path / "new.jsonl")
    fresh.close(False)
    assert (tmp_path / "new.jsonl").exists()


def test_byte_order_marks_and_other_encodings(tmp_path):
    """A UTF-8 byte-order mark is dropped (prompts files and --prompt_file); non-UTF-8 bytes name the file."""
    f = tmp_path / "p.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "hi"}\n')
    assert [i.text for i in read_prompts_file(str(f))] == ["hi"]
    f.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"--prompts_file '{f}' is not UTF-8 text"):
        read_prompts_file(str(f))
    t = tmp_path / "p.txt"
    t.write_bytes(b"\xef\xbb\xbfROMEO:")
    assert cli._read(str(t), "--prompt_file") == "ROMEO:"
    t.write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=f"--prompt_file '{t}' is not UTF-8 text"):
        cli._read(str(t), "--prompt_file")
