"""bench/msa_prefill.py's input model and selection statistics (CPU): correlated index queries
(``--index-corr``, an AR(1) process along the tokens) and the distinct blocks per query tile."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tests.paths import REPO_ROOT

sys.path.insert(0, os.path.join(str(REPO_ROOT), "bench"))

import msa_prefill  # noqa: E402


def test_correlated_normal_is_an_ar1_process_along_the_axis():
    """Jitted: one compile of the same function instead of its associative scan's eager ops one by one."""
    import jax
    import jax.numpy as jnp
    correlated_normal = jax.jit(msa_prefill.correlated_normal, static_argnums=(1, 2, 3, 4))
    key = jax.random.PRNGKey(3)
    plain = correlated_normal(key, (2, 64, 3), 1, 0.0, jnp.float32)
    np.testing.assert_array_equal(plain, jax.random.normal(key, (2, 64, 3), jnp.float32))
    for c in (0.5, 0.9):
        x = np.asarray(correlated_normal(key, (4, 4096, 8), 1, c, jnp.float32))
        e = np.asarray(jax.random.normal(key, (4, 4096, 8), jnp.float32))
        np.testing.assert_allclose(x[:, 0], e[:, 0], rtol=1e-6)             # x_0 = e_0
        want = c * x[:, :-1] + (1 - c * c) ** 0.5 * e[:, 1:]                # the recurrence, step by step
        np.testing.assert_allclose(x[:, 1:], want, rtol=1e-4, atol=1e-5)
        lag1 = np.mean(x[:, 1:] * x[:, :-1]) / np.mean(x * x)
        assert abs(lag1 - c) < 0.03 and abs(np.var(x) - 1.0) < 0.1, (c, lag1, np.var(x))
    with pytest.raises(ValueError, match=r"corr must be in \[0, 1\)"):
        msa_prefill.correlated_normal(key, (4,), 0, 1.0, jnp.float32)


def test_tile_blocks_counts_distinct_selected_blocks_per_tile():
    import jax.numpy as jnp
    ids = np.full((1, 2, 5, 3), -1, np.int32)
    ids[0, 0] = [[0, 1, -1], [1, 2, -1], [2, 3, 4], [9, -1, -1], [-1, -1, -1]]
    ids[0, 1] = [[5, 5, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]   # a repeat counts once
    got = msa_prefill.tile_blocks(jnp.asarray(ids), sizes=(1, 2, 4))
    # per token (non-empty): 2, 2, 3, 1 and 1 -> 9 / 5; pairs: {0,1,2}, {2,3,4,9}, {5} -> 8 / 3;
    # fours (5 tokens padded to 8): {0,1,2,3,4,9}, {5} -> 7 / 2
    assert got == pytest.approx({1: 9 / 5, 2: 8 / 3, 4: 7 / 2})


def test_index_corr_out_of_range_is_a_flag_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["msa_prefill.py", "--index-corr", "1.0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        msa_prefill.main()
    assert e.value.code == 2 and "--index-corr takes a value in [0, 1), got 1.0" in capsys.readouterr().err
