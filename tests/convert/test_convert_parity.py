"""HF checkpoint -> orbax conversion: our logits equal HF's (fp32, relative error <= 1e-5) for
checkpoints written by the real library (sharded ``save_pretrained`` output, M2 and M3; single
file; transformers-native M2 names). FP8 checkpoints: ``test_convert_fp8.py``."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from minimax_jax.convert.load import load_checkpoint
from minimax_jax.model import forward
from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx

jax.config.update("jax_default_matmul_precision", "highest")
_fwd = jax.jit(lambda p, t, cfg: forward(p, cfg, t).logits, static_argnums=2)


def _check_logits(model, out_dir, seed, seq=19):
    cfg, params = load_checkpoint(out_dir)
    assert cfg.param_dtype == "float32"
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (2, seq)).astype(np.int32)
    ref = hf.hf_logits(model, tokens)
    got = np.asarray(_fwd(params, jnp.asarray(tokens), cfg))
    rel = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert rel <= 1e-5, f"max relative error {rel:.3g}"
    return cfg, params


@pytest.mark.parametrize("kind", ["m2", "m2_native_rope", "m3"])
def test_save_pretrained_sharded_checkpoint(tmp_path, kind):
    hf.require_hf()
    seed = {"m2": 21, "m2_native_rope": 22, "m3": 23}[kind]
    model = hf.m3_model(seed) if kind == "m3" else hf.m2_model(seed, native_rope=kind == "m2_native_rope")
    src = fx.saved_pretrained(model, str(tmp_path / "hf"))
    shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    assert len(shards) >= 5 and os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    dst = tmp_path / "ours"
    cfg, report = convert_hf_to_orbax(src, dst, "float32", progress=False)
    assert report["warnings"] == []
    for n in fx.SIDE_FILES:
        with open(dst / n) as f:
            assert f.read() == fx.SIDE_FILES[n]
    _check_logits(model, dst, seed)


def test_single_file_checkpoint_bfloat16_values_exact(tmp_path):
    """One ``model.safetensors`` (no index), converted to bfloat16: every leaf equals the HF tensor
    cast to bfloat16 (round to nearest even) exactly."""
    hf.require_hf()
    import ml_dtypes

    from minimax_jax.convert.from_state import params_from_hf_state

    model = hf.m2_model(24)
    src = fx.saved_pretrained(model, str(tmp_path / "hf"), max_shard_size="100MB")
    assert os.listdir(src).count("model.safetensors") == 1
    cfg, _ = convert_hf_to_orbax(src, tmp_path / "ours", progress=False)
    assert cfg.param_dtype == "bfloat16"
    _, params = load_checkpoint(tmp_path / "ours")
    ref = params_from_hf_state(hf.state_of(model), cfg.replace(param_dtype="float32"))
    flat_ref = jax.tree_util.tree_flatten_with_path(ref)[0]
    flat_got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, r in flat_ref:
        g = np.asarray(flat_got[path])
        keep32 = jax.tree_util.keystr(path).endswith(("['router']", "['router_bias']"))
        want = np.asarray(r) if keep32 else np.asarray(r).astype(ml_dtypes.bfloat16)
        assert g.dtype == want.dtype, jax.tree_util.keystr(path)
        assert g.tobytes() == want.tobytes(), jax.tree_util.keystr(path)


def test_m2_native_names_in_files(tmp_path):
    """Files holding transformers' in-memory M2 names (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.e_score_correction_bias``) convert as well as the hub spelling."""
    hf.require_hf()
    import json

    model = hf.m2_model(28)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd and "model.layers.0.mlp.e_score_correction_bias" in sd
    os.makedirs(tmp_path / "hf")
    fx.write_shards(sd, str(tmp_path / "hf"), 2)
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(model.config.to_dict(), f, default=str)
    convert_hf_to_orbax(tmp_path / "hf", tmp_path / "ours", "float32", progress=False)
    _check_logits(model, tmp_path / "ours", 28)


def test_cli_converts_and_reports_speed(tmp_path, capsys):
    hf.require_hf()
    from minimax_jax.convert.cli import main

    model = hf.m2_model(27)
    src = fx.saved_pretrained(model, str(tmp_path / "hf"))
    rc = main(["--src", src, "--dst", str(tmp_path / "ours"), "--dtype", "float32", "--no-progress"])
    assert rc == 0
    assert "GB/s" in capsys.readouterr().out
    _check_logits(model, tmp_path / "ours", 27)
