"""GPU MSA kernels (interpret mode) on other storage layouts: a gathered decode cache with queries
not at the end of the keys, and duplicated / out-of-range block ids. Split from
test_msa_kernels_gpu.py (where these are marked slow) to keep each file's run short."""

from __future__ import annotations

import tests.kernels.msa.test_msa_kernels_gpu as g


def test_decode_like_layout():
    g.test_decode_like_layout_queries_not_at_the_end()


def test_duplicate_and_out_of_range_ids():
    g.test_duplicate_and_out_of_range_ids_count_once()
