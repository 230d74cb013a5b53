"""README's tiny path end to end: ``train.py --config configs/train/tiny-m3.yaml`` -> ``python -m
minimax_jax.train.export`` -> ``infer.py --checkpoint``, from the repository root, with nothing
prepared: the LM loss falls below the uniform loss ln(512), the export bundles the shipped
512-token tokenizer, and infer.py turns the model's ids into text with it."""

import json
import math
import os
import subprocess
import sys

import pytest

from minimax_jax.data.tokenizer import load_tokenizer
from tests.paths import REPO_ROOT
from tests.xla_flags import running_xla_flags

TOKENIZER = os.path.join(REPO_ROOT, "configs", "tiny-data", "tokenizer.json")
VOCAB = 512


def _run(*argv, timeout=600, env=None):
    r = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert r.returncode == 0, (argv, r.stderr[-3000:])
    return r


def _readme_path(tmp_path, *train_sets) -> list[float]:
    """Train (README command + ``train_sets``), export, infer; returns the LM loss per step. The training run's
    time is its steps more than its compile: -O1 code (tests/xla_flags.py) runs them ~5x faster than the suite's
    -O0 for a few seconds more of compiling."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    _run("train.py", "--config", "configs/train/tiny-m3.yaml", *train_sets, "--set", f"run.run_dir={run}",
         env=dict(os.environ, XLA_FLAGS=running_xla_flags(1)))
    with open(run / "metrics.jsonl") as f:
        lm = [json.loads(line)["lm_loss"] for line in f]
    r = _run("-m", "minimax_jax.train.export", "--run_dir", str(run), "--dst", str(ckpt))
    assert "no tokenizer" not in r.stderr
    with open(ckpt / "tokenizer.json", "rb") as a, open(TOKENIZER, "rb") as b:
        assert a.read() == b.read()                       # the shipped tokenizer travels with the export
    r = _run("infer.py", "--checkpoint", str(ckpt), "--prompt", "Romeo.", "--max_new_tokens", "12", "--json")
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, r.stdout
    toks, text = records[0]["tokens"], records[0]["text"]
    assert 1 <= len(toks) <= 12 and all(0 <= t < VOCAB for t in toks)
    assert text.strip() and text == load_tokenizer(TOKENIZER).decode(toks)
    return lm


def test_tiny_m3_train_export_infer(tmp_path):
    """The fast variant: 10 steps, one compiled phase (no indexer warm-up)."""
    lm = _readme_path(tmp_path, "--set", "run.steps=10", "--set", "msa.indexer_warmup_steps=0",
                      "--set", "run.progress=false", "--set", "run.tensorboard=false")
    assert len(lm) == 10
    first, last = sum(lm[:3]) / 3, sum(lm[-3:]) / 3
    assert last < first - 0.1 and last < math.log(VOCAB) - 0.1, lm


@pytest.mark.slow
def test_tiny_m3_readme_command_learns_the_text(tmp_path):
    """The README command as written (50 steps, indexer warm-up then sparse training)."""
    lm = _readme_path(tmp_path, "--set", "run.steps=50", "--set", "optim.lr=1e-3")
    assert len(lm) == 50
    assert sum(lm[-5:]) / 5 < math.log(VOCAB) - 0.8, lm
