"""Errors a user meets, each clear and raised before any compute: prompt + max_new_tokens over the
context, checkpoint/config mismatch (every mismatched parameter listed), missing tokenizer / default
checkpoint / checkpoint directory, bad prompts."""

import os

import pytest
import yaml

from minimax_jax.infer import (CheckpointMismatch, CheckpointNotFound, ContextTooLong, GenerationConfig, Generator,
                               TokenizerNotFound, load_model)
from minimax_jax.infer import loading
from tests import infer_helpers as H


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = H.chain_tokenizer(H.GOOD_PIECES)
    cfg, params = H.chain_model(tok, H.GOOD_PIECES, H.chat_prompt_ids(tok)[-1])
    return H.save_checkpoint(str(tmp_path_factory.mktemp("e") / "ckpt"), cfg, params, tok)


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.yaml")
    with open(path) as f:
        d = yaml.safe_load(f)
    d.update(changes)
    with open(path, "w") as f:
        yaml.safe_dump(d, f)


def test_context_too_long_before_any_compute(ckpt):
    m = load_model(ckpt)
    gen = Generator(m.cfg, m.params, m.tokenizer)
    limit = m.cfg.max_position_embeddings
    with pytest.raises(ContextTooLong) as e:
        gen.generate([[5] * 10, [5] * (limit - 20)], GenerationConfig(max_new_tokens=30))
    msg = str(e.value)
    assert f"prompt 1 has {limit - 20} tokens" in msg and f"context of {limit} tokens" in msg
    assert "shorten the prompt by 10 tokens or lower --max_new_tokens to at most 20" in msg
    assert gen.backend is None                        # no engine was even built


def test_context_too_long_advice_when_the_prompt_alone_is_too_long():
    """A prompt that fills the context by itself: the advice is to shorten it by N tokens, never to
    lower --max_new_tokens "to at most 0"."""
    from minimax_jax.config import ModelConfig
    from minimax_jax.infer.generation import check_context

    cfg = ModelConfig(max_position_embeddings=100)
    for n, alone, by in ((130, "is 30 tokens over the context", 78), (100, "fills the context", 48)):
        with pytest.raises(ContextTooLong) as e:
            check_context(cfg, [n], 48)
        msg = str(e.value)
        assert f"the prompt alone {alone}, so it must be shortened: by {by} tokens to keep max_new_tokens=48" in msg
        assert "at most 0" not in msg and "lower --max_new_tokens" not in msg and "\n" not in msg
    check_context(cfg, [52], 48)                      # exactly fits
    with pytest.raises(ContextTooLong) as e:          # max_new_tokens alone over the context
        check_context(cfg, [4], 2_000_000)
    assert str(e.value).endswith("lower --max_new_tokens to at most 96") and "shorten" not in str(e.value)


def test_mismatch_lists_every_parameter(ckpt, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    _edit_config(bad, vocab_size=400, dense_intermediate_size=12)
    with pytest.raises(CheckpointMismatch) as e:
        load_model(bad)
    leaves = sorted(leaf for leaf, _, _ in e.value.mismatches)
    assert leaves == sorted(["params['embed']['embedding']", "params['lm_head']",
                             "params['segments'][0]['mlp']['wi']", "params['segments'][0]['mlp']['wo']"])
    msg = str(e.value)
    assert "(4 parameters)" in msg and "config expects [16, 400], checkpoint has [16, 304]" in msg


def test_missing_files(ckpt, tmp_path, monkeypatch):
    import shutil

    no_tok = str(tmp_path / "no_tok")
    shutil.copytree(ckpt, no_tok)
    os.remove(os.path.join(no_tok, "tokenizer.json"))
    with pytest.raises(TokenizerNotFound, match=f"looked for {os.path.join(no_tok, 'tokenizer.json')}"):
        load_model(no_tok)
    with pytest.raises(TokenizerNotFound, match="elsewhere.json"):
        load_model(ckpt, tokenizer_path=str(tmp_path / "elsewhere.json"))

    monkeypatch.setattr(loading, "DEFAULT_CHECKPOINT", str(tmp_path / "checkpoints" / "demo"))
    with pytest.raises(CheckpointNotFound, match="default demo checkpoint .*checkpoints/demo is missing"):
        load_model(None)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFound, match="config.yaml \\+ params/ .* config.json \\+ \\*.safetensors"):
        load_model(str(empty))


def test_corrupt_checkpoint_and_tokenizer_files(ckpt, tmp_path):
    """Damaged files get one clear error naming the directory / file (no orbax or tokenizers traceback)."""
    import glob
    import shutil

    from minimax_jax.convert.errors import CorruptFileError

    no_manifest = str(tmp_path / "no_manifest")
    shutil.copytree(ckpt, no_manifest)
    for f in glob.glob(os.path.join(no_manifest, "params", "manifest.ocdbt")) + \
            glob.glob(os.path.join(no_manifest, "params", "_METADATA")):
        os.remove(f)
    with pytest.raises(CorruptFileError, match=f"checkpoint {no_manifest}/params is incomplete or corrupt"):
        load_model(no_manifest)

    truncated = str(tmp_path / "truncated")
    shutil.copytree(ckpt, truncated)
    data = [f for f in glob.glob(os.path.join(truncated, "params", "**", "d", "*"), recursive=True)
            if os.path.isfile(f)]
    assert data, os.listdir(os.path.join(truncated, "params"))
    for f in data:
        with open(f, "r+b") as fh:
            fh.truncate(20)
    # orbax reads some array metadata from the data files: either check may be the one that fails
    with pytest.raises(CorruptFileError, match=f"checkpoint {truncated}/params(:| is incomplete or) .*corrupt"):
        load_model(truncated)

    bad_tok = tmp_path / "tok.json"
    bad_tok.write_text("x")
    with pytest.raises(TokenizerNotFound, match=f"{bad_tok} is not a valid tokenizer.json"):
        load_model(ckpt, tokenizer_path=str(bad_tok))


def test_bad_prompts(ckpt):
    m = load_model(ckpt)
    gen = Generator(m.cfg, m.params, m.tokenizer)
    with pytest.raises(ValueError, match="^the prompt is empty"):
        gen.generate([[]])
    with pytest.raises(ValueError, match="^prompt 1 is empty"):
        gen.generate([[1], []])
    with pytest.raises(ValueError, match="outside \\[0, 304\\)"):
        gen.generate([[1, 304]])
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        Generator(m.cfg, m.params, engine="fast").generate([[1]], GenerationConfig(max_new_tokens=1))


def test_non_finite_sampling_values_and_a_file_as_checkpoint(tmp_path):
    import jax.numpy as jnp

    from minimax_jax.infer.sampler import SamplingParams
    from minimax_jax.sampling import filter_logits

    for kw in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}):
        with pytest.raises(ValueError, match="must be a finite number"):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="temperature=nan is outside"):
        filter_logits(jnp.zeros((1, 4)), temperature=float("nan"))
    f = tmp_path / "ckpt_file"
    f.write_text("x")
    with pytest.raises(CheckpointNotFound, match="is a file; pass the checkpoint directory"):
        load_model(str(f))


def test_bad_stop_rules_fail_when_the_config_is_made():
    """Before any model is loaded (infer.py builds the GenerationConfig first)."""
    with pytest.raises(ValueError, match="non-empty strings"):
        GenerationConfig(stop_strings=("",))
    with pytest.raises(ValueError, match="set both repeat_max_period and repeat_max_count"):
        GenerationConfig(repeat_max_period=4)
    GenerationConfig(stop_strings=["END"], repeat_max_period=4, repeat_max_count=2)


def test_context_too_long_names_a_prompts_file_value():
    """A max_new_tokens from a prompts-file line (passed per prompt) is named as such in the advice."""
    from minimax_jax.config import ModelConfig
    from minimax_jax.infer.generation import check_context

    cfg = ModelConfig(max_position_embeddings=100)
    with pytest.raises(ContextTooLong, match=r"at most 96 \(or that prompt's \"max_new_tokens\" in the prompts file\)"):
        check_context(cfg, [4], [2000000])
    with pytest.raises(ContextTooLong) as e:
        check_context(cfg, [4], 2000000)
    assert "prompts file" not in str(e.value)
