"""TPU MSA kernels (interpret mode): the race-detecting TPU interpreter and a gathered decode-cache
layout (queries not at the end of the keys). Split from test_msa_kernels_tpu.py (where these are
marked slow) to keep each file's run short."""

from __future__ import annotations

import tests.kernels.msa.test_msa_kernels_tpu as t


def test_forward_with_race_detection():
    t.test_forward_with_race_detection()


def test_decode_like_layout():
    t.test_decode_like_layout_queries_not_at_the_end()
