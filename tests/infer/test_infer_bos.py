"""``infer.py --bos``: raw prompts start with the BOS token (as every training document does), chats and prompts
that already start with it are left alone, and a tokenizer without it is refused by name."""

import types

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from minimax_jax.chat.tokens import BOS
from minimax_jax.config import ModelConfig
from minimax_jax.infer import cli
from minimax_jax.infer.prompts_io import PromptItem
from tests.paths import REPO_ROOT

DEMO = f"{REPO_ROOT}/checkpoints/demo"


@pytest.fixture(scope="module")
def tok_cfg():
    return Tokenizer.from_file(f"{DEMO}/tokenizer.json"), ModelConfig.from_yaml(f"{DEMO}/config.yaml")


CONFIG = types.SimpleNamespace(max_new_tokens=8)


def test_bos_goes_before_raw_prompts_only(tok_cfg):
    tok, cfg = tok_cfg
    bos = tok.token_to_id(BOS)
    raw = PromptItem(0, 0, "ROMEO:")
    already = PromptItem(1, 1, BOS + "ROMEO:")
    chat = PromptItem(2, 2, "ROMEO:", chat=object())
    plain = cli._encode([raw, already, chat], tok, cfg, CONFIG)
    got = cli._encode([raw, already, chat], tok, cfg, CONFIG, bos=True)
    assert plain[0][0] != bos and plain[1][0] == bos
    assert got[0] == [bos, *plain[0]]           # added
    assert got[1] == plain[1]                   # not doubled
    assert got[2] == plain[2]                   # a chat renders its own
    with pytest.raises(ValueError, match="empty"):
        cli._encode([PromptItem(0, 0, "")], tok, cfg, CONFIG, bos=True)


def test_bos_needs_the_token(tok_cfg):
    _, cfg = tok_cfg
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    assert cli._encode([PromptItem(0, 0, "a")], bare, cfg, CONFIG) == [[0]]
    with pytest.raises(ValueError, match="no BOS token"):
        cli._encode([PromptItem(0, 0, "a")], bare, cfg, CONFIG, bos=True)
