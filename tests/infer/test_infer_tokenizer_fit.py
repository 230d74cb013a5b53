"""infer refuses a tokenizer whose ids do not fit the model's vocabulary up front (one line), as export
does, instead of failing on the first prompt that happens to use an id >= vocab_size."""

from __future__ import annotations

import dataclasses
import os

import pytest
from tokenizers import Tokenizer

from minimax_jax.infer.errors import TokenizerNotFound
from minimax_jax.infer.loading import check_tokenizer_fits, peek_config
from tests.paths import REPO_ROOT

DEMO = os.path.join(REPO_ROOT, "checkpoints", "demo")


def test_a_larger_tokenizer_is_refused_a_smaller_one_accepted():
    cfg = peek_config(DEMO)
    demo_tok = Tokenizer.from_file(os.path.join(DEMO, "tokenizer.json"))
    tiny_tok = Tokenizer.from_file(os.path.join(REPO_ROOT, "configs", "tiny-data", "tokenizer.json"))
    check_tokenizer_fits(demo_tok, cfg, "demo")                  # equal sizes
    check_tokenizer_fits(tiny_tok, cfg, "tiny")                  # smaller: fine
    small = dataclasses.replace(cfg, vocab_size=512)
    with pytest.raises(TokenizerNotFound, match=r"tokenizer demo has ids up to \d+ but the model's vocab_size is 512"):
        check_tokenizer_fits(demo_tok, small, "demo")
