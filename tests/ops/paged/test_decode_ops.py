"""Paged decode ops (``minimax_jax.ops.paged``, implementation="xla") against a NumPy oracle.

Q in {1, 2, 8, 16} rows (speculative verification), float32 / bf16 / fp8 e4m3 caches, shuffled
page tables, padding rows, the tie case; dispatch, recording and refusals; sliding windows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from minimax_jax.ops import paged as ops
from minimax_jax.ops.registry import ImplementationUnavailable, clear_implementation_report, implementation_report
from tests.ops.paged.test_decode_oracle import D, K, PAGE, check_against_oracle, check_all_equal_scores, make_case


@pytest.mark.parametrize("nq,kv_dtype", [(1, "float32"), (2, "float8_e4m3fn"), (8, "bfloat16"), (16, "float32")])
def test_xla_matches_oracle(nq, kv_dtype):
    check_against_oracle("xla", nq, kv_dtype)


def test_xla_all_equal_scores():
    check_all_equal_scores("xla")


def test_dispatch_records_and_refuses():
    rng = np.random.default_rng()
    c = make_case(rng, 1)
    clear_implementation_report()
    ops.msa_decode(c["q"], c["qi"], c["k"], c["v"], c["ki"], c["table"], c["pos"], topk=K, implementation="auto")
    rep = implementation_report()
    assert rep["msa_decode_select"] == "xla" and rep["paged_attention"] == "xla"   # CPU: auto -> xla
    with pytest.raises(ImplementationUnavailable, match="unknown implementation"):
        ops.paged_attention(c["q"], c["k"], c["v"], c["table"], c["pos"], implementation="cuda")
    with pytest.raises(ImplementationUnavailable, match="sliding"):
        ops.paged_attention(c["q"], c["k"], c["v"], c["table"], c["pos"], sliding_window=8,
                            implementation="pallas_tpu_interpret")
    with pytest.raises(ImplementationUnavailable, match="unknown implementation"):       # the old name
        ops.paged_attention(c["q"], c["k"], c["v"], c["table"], c["pos"], implementation="pallas_interpret")
    with pytest.raises(ImplementationUnavailable, match="needs a GPU backend"):           # CPU: no Triton kernel
        ops.msa_decode_select(c["qi"], c["ki"], c["table"], c["pos"], topk=K, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="q_positions"):
        ops.paged_attention(c["q"], c["k"], c["v"], c["table"], c["pos"][:, :0], implementation="xla")


def test_sliding_window_reference():
    rng = np.random.default_rng()
    c = make_case(rng, 2, b=1)
    n = c["np"]
    o, _ = ops.paged_attention(c["q"], c["k"], c["v"], c["table"], c["pos"], sliding_window=20, implementation="xla")
    pos = int(n["pos"][0, 0])
    keys = np.arange(pos - 19, pos + 1)
    kk = n["k"][0, n["table"][0, keys // PAGE], keys % PAGE]
    vv = n["v"][0, n["table"][0, keys // PAGE], keys % PAGE]
    s = kk @ n["q"][0, 0, 0] / math.sqrt(D)
    e = np.exp(s - s.max())
    np.testing.assert_allclose(np.asarray(o)[0, 0, 0], e @ vv / e.sum(), atol=2e-5)
