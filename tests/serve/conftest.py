"""Fixtures of the server tests: the shipped demo model (loaded once) and the reference generation loop
over it (``minimax_jax.infer.Generator``, plain decoding, ``PREFILL_CHUNK``; one engine for every reference)."""

import pytest

from minimax_jax.infer.generation import Generator
from minimax_jax.infer.loading import load_model
from tests.serve.serving import PREFILL_CHUNK


@pytest.fixture(scope="session")
def demo():
    return load_model(None, log=lambda _m: None)


@pytest.fixture(scope="session")
def gen(demo):
    g = Generator(demo.cfg, demo.params, demo.tokenizer, engine_options={"prefill_chunk": PREFILL_CHUNK})
    g.reserve(2, 512)
    return g
