"""The shipped demo checkpoint (checkpoints/demo): it loads with its tokenizer and generates
deterministic text, the same on the paged engine and the full-recompute engine (issue 10).

The golden prefix was recorded on CPU when the checkpoint was shipped (2026-12-01, the MSA run of
experiments/three_way run 5, RESULTS.md: a shared copy-curriculum stage 1, then 1,400 steps of 8 x 4,096
tokens); a different checkpoint must update it.
"""

import os

import pytest

from minimax_jax.infer.generation import GenerationConfig, Generator
from minimax_jax.infer.loading import DEFAULT_CHECKPOINT, load_model

PROMPTS = ["ROMEO:", "def main("]
GOLDEN_PREFIX = [[229, 25, 26, 26, 26, 26, 26, 26], [92, 92, 92, 92, 92, 17, 17, 17]]


@pytest.fixture(scope="module")
def demo():
    if not os.path.isdir(DEFAULT_CHECKPOINT):
        pytest.fail(f"the shipped checkpoint {DEFAULT_CHECKPOINT} is missing from the repository")
    return load_model(None)


def _greedy(m, engine):
    g = Generator(m.cfg, m.params, m.tokenizer, engine=engine)
    out = g.generate_text(PROMPTS, GenerationConfig(max_new_tokens=16, stop_token_ids=()))  # greedy by default
    return [list(map(int, s.tokens)) for s in out.sequences], [s.text for s in out.sequences]


def test_shipped_checkpoint_is_the_documented_model(demo):
    cfg = demo.cfg
    assert cfg.layer_types == ("full", "full", "msa", "msa", "msa", "msa")
    assert cfg.max_position_embeddings == 1 << 20 and cfg.vocab_size == 2048 and cfg.tie_word_embeddings
    assert demo.tokenizer.get_vocab_size() == cfg.vocab_size


def test_shipped_checkpoint_generates_deterministically(demo):
    paged, text = _greedy(demo, "paged")
    again, _ = _greedy(demo, "paged")
    recompute, _ = _greedy(demo, "recompute")
    assert paged == again == recompute
    assert all(len(t) == 16 for t in paged) and all(isinstance(s, str) and s for s in text)
    assert [t[:8] for t in paged] == GOLDEN_PREFIX
