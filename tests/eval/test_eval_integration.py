"""The eval CLI end to end through the real inference runtime, on a tiny random checkpoint."""

import json
import math
import os
import sysconfig

import jax
import pytest

infer = pytest.importorskip("minimax_jax.infer")
H = pytest.importorskip("tests.infer_helpers")

from minimax_jax.eval import cli  # noqa: E402
from minimax_jax.model import init_params  # noqa: E402

STD = sysconfig.get_paths()["stdlib"]


def test_eval_cli_runs_a_real_checkpoint(tmp_path):
    tok = H.tiny_tokenizer()
    cfg = H.tiny_config(tok.get_vocab_size())
    ckpt = H.save_checkpoint(str(tmp_path / "ckpt"), cfg, init_params(cfg, jax.random.key(0)), tok)
    ppl = tmp_path / "heldout.txt"
    ppl.write_text(open(os.path.join(STD, "json", "encoder.py")).read())
    out = tmp_path / "r.json"
    assert cli.main(["--checkpoint", ckpt, "--tasks", "niah_single,common_words", "--lengths", "600",
                     "--num_samples", "1", "--max_new_tokens", "3", "--haystack", "noise",
                     "--ppl_files", str(ppl), "--ppl_seq_len", "64", "--ppl_max_tokens", "300",
                     "--out", str(out)]) == 0
    r = json.load(open(out))
    assert [e["task"] for e in r["examples"]] == ["common_words", "niah_single"]  # shortest first, then by name
    for e in r["examples"]:
        assert isinstance(e["output"], str) and 0.0 <= e["score"] <= 1.0
        assert 600 - 8 <= e["length"] <= 600
    p = r["perplexity"]
    assert p["tokens"] == 299 and math.isfinite(p["perplexity"]) and p["perplexity"] > 1.0
    # a random init predicts close to uniformly over the vocabulary
    assert 0.5 * cfg.vocab_size < p["perplexity"] < 2.0 * cfg.vocab_size
