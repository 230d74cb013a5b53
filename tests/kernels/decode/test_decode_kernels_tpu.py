"""TPU (Mosaic) decode kernels in interpret mode (implementation 'pallas_tpu_interpret'), against the NumPy oracle.

Selection sets, dense and sparse attention (o and lse, every element),
Q in {1, 2, 8, 16}, float32 / bf16 / fp8 e4m3 caches, the all-equal-scores tie case.
"""

from __future__ import annotations

import pytest

from tests.ops.paged.test_decode_oracle import check_against_oracle, check_all_equal_scores


@pytest.mark.parametrize("nq,kv_dtype", [(1, "float32"), (2, "float8_e4m3fn"), (8, "bfloat16"), (16, "float32")])
def test_kernels_match_oracle(nq, kv_dtype):
    check_against_oracle("pallas_tpu_interpret", nq, kv_dtype, ordered=False)


def test_all_equal_scores():
    check_all_equal_scores("pallas_tpu_interpret")

