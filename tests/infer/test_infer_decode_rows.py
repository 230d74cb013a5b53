"""``--decode_rows`` (``engine_options["query_rows"]``): every decode step padded to the same row count, so
speculative and plain greedy decoding run every matrix product at the same shapes (issue 34).

CPU: the option reaches the engine, a too-small value for the drafts is refused in one line, the CLI
refuses it off the paged engine, and with it the demo model's (bf16) speculative greedy output equals
its plain greedy output (without it the one-row steps round differently: bench/spec_decode.py).
GPU (runs only there): >= 1,000 new tokens at three prompt lengths, speculative vs plain greedy with
``query_rows = 1 + drafts`` (issue 34's acceptance test: the shared-tile sparse decode kernel gives a row the
same splits and page order whatever the other rows selected, ``pallas_kernels.decode.common.union_pages``)."""

import jax
import numpy as np
import pytest

from minimax_jax.infer import GenerationConfig, Generator
from minimax_jax.infer.loading import load_model


@pytest.fixture(scope="module")
def demo():
    return load_model(None)


def _prompts(cfg, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]


def test_decode_rows_reach_the_engine_and_keep_greedy_output(demo):
    cfg, params = demo.cfg, demo.params
    k = cfg.num_mtp_modules
    gen = Generator(cfg, params, engine_options={"query_rows": 1 + k})
    prompts = _prompts(cfg, [64], seed=0)
    plain = gen.generate(prompts, GenerationConfig(max_new_tokens=32, stop_token_ids=()))
    assert gen.backend.engine.query_rows == 1 + k and "decode rows=" + str(1 + k) in gen.backend.describe()
    spec = gen.generate(prompts, GenerationConfig(max_new_tokens=32, stop_token_ids=(), speculative="mtp"))
    assert gen.backend.engine.query_rows == 1 + k
    assert [s.tokens for s in spec.sequences] == [s.tokens for s in plain.sequences] and spec.stats.drafted > 0


def test_too_few_decode_rows_for_the_drafts_is_refused(demo):
    cfg, params = demo.cfg, demo.params
    gen = Generator(cfg, params, engine_options={"query_rows": 1})
    with pytest.raises(ValueError, match="cannot hold a speculative step"):
        gen.generate(_prompts(cfg, [8]), GenerationConfig(max_new_tokens=4, speculative="mtp"))


@pytest.mark.parametrize("argv,needle", [
    (["--engine", "recompute", "--decode_rows", "2"], "--decode_rows needs --engine paged and a value in [1, 16]"),
    (["--decode_rows", "17"], "--decode_rows needs --engine paged and a value in [1, 16]"),
    (["--speculative", "mtp", "--num_draft", "2", "--decode_rows", "2"], "--decode_rows 2 cannot hold 1 + 2 drafts"),
    (["--decode_loop", "4"], "decode_loop > 1 runs greedy decoding (temperature 0, plain or speculative) on the "
                             "device; it cannot serve sampling (temperature > 0)"),
    (["--decode_loop", "4", "--temperature", "0", "--logprobs", "--json"], "cannot serve logprobs"),
    (["--decode_loop", "4", "--temperature", "0", "--engine", "recompute"], "--decode_loop > 1 needs --engine paged"),
    (["--decode_loop", "0"], "--decode_loop")])
def test_cli_refuses_bad_decode_rows_and_loops(argv, needle, capsys):
    from minimax_jax.infer import cli as infer_cli

    try:
        status = infer_cli.main(["--prompt", "hi", *argv])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU numerics (the CPU path is tested above)")
def test_gpu_speculative_greedy_equals_plain_greedy_with_equal_decode_rows(demo):
    cfg, params = demo.cfg, demo.params
    k = cfg.num_mtp_modules
    gen = Generator(cfg, params, engine_options={"query_rows": 1 + k})
    for n, prompt in zip((512, 1000, 4000), _prompts(cfg, (512, 1000, 4000), seed=1)):
        config = GenerationConfig(max_new_tokens=1024, stop_token_ids=())
        plain = gen.generate([prompt], config).sequences[0].tokens
        spec = gen.generate([prompt], GenerationConfig(max_new_tokens=1024, stop_token_ids=(),
                                                       speculative="mtp")).sequences[0].tokens
        assert len(plain) == 1024
        first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
        assert spec == plain, f"prompt {n}: first difference at new token {first}"


@pytest.mark.parametrize("argv,want", [
    (["--temperature", "0"], 16),
    ([], 1),                                                          # sampling (temperature 1)
    (["--temperature", "0", "--repetition_penalty", "1.2"], 1),
    (["--temperature", "0", "--logprobs", "--json"], 1),
    (["--temperature", "0", "--speculative", "mtp"], 1),
    (["--temperature", "0", "--engine", "recompute"], 1),
    (["--temperature", "0", "--decode_rows", "2"], 1),
    (["--temperature", "0", "--decode_loop", "4"], 4),
    (["--temperature", "0", "--decode_loop", "1"], 1),
    (["--temperature", "0", "--max_new_tokens", "3"], 3),                # auto: at most --max_new_tokens
    (["--temperature", "0", "--max_new_tokens", "1"], 1),
    (["--temperature", "0", "--decode_loop", "256"], 256)])
def test_cli_decode_loop_auto(argv, want):
    """--decode_loop auto (the default): 16 steps per device loop for greedy plain decoding, else 1."""
    from minimax_jax.infer import cli as infer_cli

    infer_cli.parse(["--prompt", "hi", *argv])
    infer_cli.check_flags()
    assert infer_cli._config().decode_loop == want


def test_cli_decode_loop_bad_value_is_one_line(capsys):
    from minimax_jax.infer import cli as infer_cli

    with pytest.raises(SystemExit) as e:
        infer_cli.main(["--prompt", "hi", "--decode_loop", "fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert 'expected "auto" or an integer in [1, 256]' in err[-1], err
    with pytest.raises(SystemExit) as e:
        infer_cli.main(["--prompt", "hi", "--decode_loop", "1000000"])      # the cache would be sized for it
    assert e.value.code == 2 and "[1, 256]" in capsys.readouterr().err
