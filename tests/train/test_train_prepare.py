"""prepare_data builds the corpus and tokenizer a config names when they are missing (the demo run)."""

import os

from minimax_jax.train.config import from_dict
from minimax_jax.train.prepare import prepare_data
from tests.train_helpers import micro_train_dict


def test_prepare_builds_missing_corpus_and_tokenizer(tmp_path):
    src = str(tmp_path / "data" / "corpus" / "train-*.jsonl")
    tok = str(tmp_path / "data" / "tokenizer" / "tokenizer.json")
    tc = from_dict(micro_train_dict(str(tmp_path / "run"), data={
        "kind": "grain", "sources": [src], "tokenizer": tok, "seq_len": 32, "batch_size": 2}))
    made = prepare_data(tc, 300, max_mb=0.2, log=lambda _: None)
    assert len(made) == 2 and os.path.isfile(tok)
    assert os.path.isfile(tmp_path / "data" / "corpus" / "heldout.jsonl")
    from minimax_jax.data.tokenizer import load_tokenizer

    t = load_tokenizer(tok)
    assert t.get_vocab_size() <= 300
    # one token per digit (the retrieval answers are numbers; RESULTS.md run 4)
    digits = [p.strip("Ġ ") for p in t.encode("code 7084729 and 1234").tokens if any(c.isdigit() for c in p)]
    assert digits == list("7084729") + list("1234"), digits
    assert prepare_data(tc, 300, max_mb=0.2) == []  # nothing missing any more


def test_cli_prepare_max_mb_sizes_the_corpus(tmp_path):
    """train.py --prepare_data --prepare_max_mb: the corpus it builds has about that much text."""
    import glob
    import subprocess
    import sys

    from tests.train_helpers import REPO, subprocess_env, write_yaml

    src = str(tmp_path / "data" / "corpus" / "train-*.jsonl")
    tok = str(tmp_path / "data" / "tokenizer" / "tokenizer.json")
    raw = micro_train_dict(str(tmp_path / "run"), data={"kind": "grain", "sources": [src], "tokenizer": tok,
                                                        "seq_len": 32, "batch_size": 2, "num_threads": 0})
    raw["run"]["steps"] = 1
    cfg = write_yaml(raw, str(tmp_path / "c.yaml"))
    out = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), "--config", cfg, "--prepare_data",
                          "--prepare_max_mb", "0.2"], cwd=REPO, env=subprocess_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    size = sum(os.path.getsize(p) for p in glob.glob(src))
    assert 0 < size < 0.5e6, size                      # the default would be 64 MB
    assert os.path.isfile(tok) and "completed at step 1" in out.stdout + out.stderr
