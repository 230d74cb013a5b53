"""``GenerationConfig.decode_loop`` / ``infer.py --decode_loop``: greedy plain decoding in device loops gives
the tokens and stop reasons of one step at a time (the shipped bf16 demo model, a sparse MSA
context, a stop token inside a loop, a length limit that is not a multiple of the loop); what it cannot serve
is refused in one line (the CLI's refusals: tests/infer/test_infer_decode_rows.py). The speculative loop:
tests/infer/test_spec_loop.py."""

from __future__ import annotations

import numpy as np
import pytest

from minimax_jax.infer import GenerationConfig, Generator
from minimax_jax.infer.loading import load_model
from minimax_jax.infer.sampler import SamplingParams


@pytest.fixture(scope="module")
def demo():
    return load_model(None)


def test_loop_gives_the_tokens_of_one_step_at_a_time(demo):
    cfg, params = demo.cfg, demo.params
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (600, 90)]
    gen = Generator(cfg, params)
    plain = gen.generate(prompts, GenerationConfig(max_new_tokens=13, stop_token_ids=()))
    stop = plain.sequences[1].tokens[6]                    # row 1 stops inside the second loop of 4
    runs = []
    for loop in (1, 4):
        out = gen.generate(prompts, GenerationConfig(max_new_tokens=13, stop_token_ids=(stop,), decode_loop=loop))
        runs.append(([(s.tokens, s.stop_reason) for s in out.sequences], out.stats))
    (a, _), (b, stats) = runs
    assert a == b and b[1][1] == "stop_token" and b[0][1] == "length" and len(b[0][0]) == 13
    assert "decode loop=4" in stats.engine and stats.decode_steps == 12       # 12 tokens after the first: 3 loops of 4


@pytest.mark.parametrize("kw,needle", [
    (dict(sampling=SamplingParams(temperature=0.7)), "sampling"),
    (dict(logprobs=True), "logprobs"),
    (dict(sampling=SamplingParams(repetition_penalty=1.2)), "penalties")])
def test_config_refuses_what_the_loop_cannot_serve(kw, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationConfig(decode_loop=4, **kw)


def test_loop_reaches_the_model_context_end(demo):
    """prompt + max_new_tokens == the model's context: the last tokens, where a whole loop no longer fits the
    engine, come from plain steps, and the output equals one step at a time."""
    cfg = demo.cfg.replace(max_position_embeddings=128)
    gen = Generator(cfg, demo.params)
    prompt = np.random.default_rng(4).integers(3, cfg.vocab_size, 118).tolist()
    outs = [gen.generate([prompt], GenerationConfig(max_new_tokens=10, stop_token_ids=(), decode_loop=n))
            for n in (1, 4)]
    assert outs[0].sequences[0].tokens == outs[1].sequences[0].tokens and len(outs[1].sequences[0].tokens) == 10


def test_loop_off_the_paged_engine_is_refused_before_any_work(demo):
    from minimax_jax.infer.errors import EngineUnavailable

    gen = Generator(demo.cfg, demo.params, engine="recompute")
    with pytest.raises(EngineUnavailable, match="decode_loop > 1 needs the paged engine"):
        gen.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=1, decode_loop=4))
    assert gen.backend is None
