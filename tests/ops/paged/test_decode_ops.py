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
    rng = np.random.default_rng(0)
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
    rng = np.random.default_rng(1)
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


def test_byte_pair_caches_are_recorded():
    """fp8 caches of 2**31 - 2**32 elements (K / V: 4 x 32,768 pages of 128 x 128; index keys: 131,072 pages) reach
    the Triton decode kernels as uint16 byte pairs (an XLA bitcast): the ops report says so (traced only, nothing
    allocated); a smaller fp8 cache records nothing of the kind."""
    import jax
    import jax.numpy as jnp
    S, fp8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn
    b, g, hg, d, page, np_ = 2, 4, 16, 128, 128, 64
    for p_kv, p_ki, paired in ((1 << 15, 1 << 17, True), (1 << 10, 1 << 10, False)):
        clear_implementation_report()
        jax.eval_shape(lambda q, k, v, t, pos, ks: ops.paged_attention(
            q, k, v, t, pos, k_scale=ks, v_scale=ks, implementation="pallas_gpu_interpret"),
            S((b, 1, g * hg, d), jnp.bfloat16), S((g, p_kv, page, d), fp8), S((g, p_kv, page, d), fp8),
            S((b, np_), jnp.int32), S((b, 1), jnp.int32), S((g, p_kv, page), jnp.float32))
        jax.eval_shape(lambda qi, ki, t, pos, ks: ops.msa_decode_select(
            qi, ki, t, pos, ki_scale=ks, topk=K, implementation="pallas_gpu_interpret"),
            S((b, 1, g, d), jnp.bfloat16), S((p_ki, page, d), fp8), S((b, np_), jnp.int32), S((b, 1), jnp.int32),
            S((p_ki, page), jnp.float32))
        rep = implementation_report()
        for key in ("paged_attention.byte_pairs", "msa_decode_select.byte_pairs"):
            assert (key in rep and "uint16 byte pairs" in rep[key]) == paired, (key, rep)


def test_near_tie_acceptance_takes_only_tied_swaps():
    """The oracle comparison's near-tie rule: a swap of two pages scoring within 1e-5 is the kernel's call; a
    swap of pages 0.1 apart is a wrong selection."""
    from tests.ops.paged.test_decode_oracle import accept_near_ties
    want = np.array([[[[0, 1, 3]]]])
    scores = np.array([[[[2.0, 1.0, 1.0 + 1e-7, np.nan]]]])
    got = np.array([[[[0, 2, 3]]]])
    assert accept_near_ties(got, want, scores).tolist() == got.tolist()
    with pytest.raises(AssertionError, match="no near-tie"):
        accept_near_ties(got, want, np.array([[[[2.0, 1.0, 0.9, np.nan]]]]))
