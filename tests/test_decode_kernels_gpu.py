"""GPU (Triton-lowered) decode kernels in Pallas interpret mode, against the NumPy oracle.

Selection sets and order, dense and sparse attention (o and lse, every element),
Q in {1, 2, 8, 16}, float32 / bf16 / fp8 e4m3 caches, the all-equal-scores tie case.
"""

from __future__ import annotations

import pytest

from tests.test_decode_oracle import check_against_oracle, check_all_equal_scores


@pytest.mark.parametrize("nq,kv_dtype", [(1, "float32"), (2, "float8_e4m3fn"), (8, "bfloat16"), (16, "float32")])
def test_kernels_match_oracle(nq, kv_dtype):
    check_against_oracle("gpu_interpret", nq, kv_dtype, ordered=True)


def test_all_equal_scores():
    check_all_equal_scores("gpu_interpret")
