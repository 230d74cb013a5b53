"""GPU MSA kernels (interpret mode): bf16 tolerances with bitwise determinism, dense equivalence
for short contexts, one MSA_SPEC length case. Split from test_msa_kernels_gpu.py (where these are
marked slow) to keep each file's run short."""

from __future__ import annotations

import tests.kernels.msa.test_msa_kernels_gpu as g


def test_bf16_tolerances_and_determinism():
    g.test_attention_bf16_tolerances_and_determinism()


def test_short_context_equals_dense():
    g.test_short_context_equals_dense_causal_attention()


def test_length_case_129():
    g.test_length_cases_block128_top16(129)
