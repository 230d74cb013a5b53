"""``load_model(convert_dir=...)`` / ``infer.py --convert_dir``: an existing folder is reused only when it holds
this tool's conversion of the same HF checkpoint at the same dtype; anything else is refused with one line and
nothing is loaded or written."""

import os

import pytest

from minimax_jax.data.tokenizer import save_tokenizer
from minimax_jax.infer import load_model
from minimax_jax.infer.errors import ConversionMismatch
from tests import hf_fixtures as hf
from tests import infer_helpers as H


def _hf_dir(path, seed):
    hf.m2_model(seed=seed, vocab=320).save_pretrained(str(path))
    save_tokenizer(H.tiny_tokenizer(), str(path))
    return str(path)


def test_convert_dir_is_reused_only_for_the_same_source_and_dtype(tmp_path):
    hf.require_hf()
    a, b = _hf_dir(tmp_path / "a", 1), _hf_dir(tmp_path / "b", 2)
    cd = str(tmp_path / "conv")
    logs = []
    load_model(a, dtype="float32", convert_dir=cd, log=logs.append)
    assert any("converting" in s for s in logs)
    logs.clear()
    m = load_model(a, dtype="float32", convert_dir=cd, log=logs.append)
    assert m.source.startswith("hf (converted earlier") and any("earlier conversion" in s for s in logs)
    before = sorted(os.listdir(cd))
    with pytest.raises(ConversionMismatch, match=r"source .*this call: .*b'"):
        load_model(b, dtype="float32", convert_dir=cd, log=logs.append)
    with pytest.raises(ConversionMismatch, match=r"dtype 'float32' \(this call: 'bfloat16'\)"):
        load_model(a, dtype="bfloat16", convert_dir=cd, log=logs.append)
    assert sorted(os.listdir(cd)) == before
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionMismatch, match="not a conversion written by this tool"):
        load_model(a, dtype="float32", convert_dir=str(other), log=logs.append)
    assert os.listdir(other) == ["notes.txt"]
