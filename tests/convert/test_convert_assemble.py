"""Unit assembly: reading big pieces in row ranges (FP8 blocks kept whole) and the XLA transpose
path give exactly the same leaves as the plain path."""

import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.convert import assemble
from minimax_jax.convert.plan import make_plan
from minimax_jax.convert.safetensors_io import SafetensorsReader
from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx


def _all_units(src, dtype, **fill_kw):
    r = SafetensorsReader(src)
    cfg = ModelConfig.from_hf_config(src)
    plan = make_plan(r, cfg, dtype=dtype)
    read = assemble.PieceReader(r, plan)
    out = {}
    for leaf in plan.leaves:
        for idx, pieces in leaf.units:
            buf = np.full(leaf.unit_shape, np.nan, leaf.dtype)
            out[(leaf.path, idx)] = assemble.fill_unit(buf, pieces, read, **fill_kw)
    return out


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_row_chunked_reads_equal_whole_reads(tmp_path, fp8):
    hf.require_hf()
    import torch

    fx.hub_checkpoint(fx.wide_m2(61), str(tmp_path), fp8=fp8, dtype=None if fp8 else torch.bfloat16)
    whole = _all_units(str(tmp_path), "float32")
    chunked = _all_units(str(tmp_path), "float32", chunk_bytes=4096)
    assert whole.keys() == chunked.keys()
    for k in whole:
        assert not np.isnan(whole[k]).any(), k  # every element written
        assert whole[k].tobytes() == chunked[k].tobytes(), k


def test_xla_transpose_path_equals_numpy_path(tmp_path, monkeypatch):
    """Force every transposed piece (2-D [out,in] and 3-D native experts [E, 2I, H]) through XLA."""
    hf.require_hf()
    src = fx.saved_pretrained(hf.m3_model(62), str(tmp_path / "hf"))
    monkeypatch.setattr(assemble, "_FAST_MIN", 1 << 62)
    ref = _all_units(src, "bfloat16")
    monkeypatch.setattr(assemble, "_FAST_MIN", 0)
    calls = []
    real = assemble._cpu_transpose
    monkeypatch.setattr(assemble, "_cpu_transpose", lambda a, p: calls.append(p) or real(a, p))
    got = _all_units(src, "bfloat16")
    assert (0, 2, 1) in calls and (1, 0) in calls
    for k in ref:
        assert ref[k].tobytes() == got[k].tobytes(), k
