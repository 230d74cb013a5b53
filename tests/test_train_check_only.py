"""`train.py --check_only` validates without compiling and says what data is missing."""

import subprocess
import sys


def _check_only(*args):
    return subprocess.run([sys.executable, "train.py", "--check_only", *args], capture_output=True, text=True,
                          timeout=300)


def test_check_only_reports_missing_corpus_and_tokenizer(tmp_path):
    r = _check_only("--set", f"data.sources=[{tmp_path}/none-*.jsonl]", "--set", f"data.tokenizer={tmp_path}/t.json")
    assert r.returncode == 0, r.stderr
    assert "# model: 13,289,232 params" in r.stdout
    assert f"# data: sources ['{tmp_path}/none-*.jsonl']: missing, would be built first" in r.stdout
    assert f"# data: tokenizer {tmp_path}/t.json: missing, would be trained on the corpus first" in r.stdout
    assert not (tmp_path / "t.json").exists()          # nothing is built by a check


def test_check_only_synthetic_data_needs_nothing():
    r = _check_only("--config", "configs/train/tiny-m3.yaml")
    assert r.returncode == 0, r.stderr
    assert "# model:" in r.stdout and "# data:" not in r.stdout
