"""HF checkpoint -> orbax conversion: our logits equal HF's (fp32, relative error <= 1e-5) for
checkpoints written by the real library (sharded ``save_pretrained`` output, M2 and M3) and for FP8
hub-layout checkpoints (compared with an HF model holding the dequantised weights)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from minimax_jax.convert.load import load_checkpoint
from minimax_jax.model import forward
from tests import hf_fixtures as hf
from tests import test_convert_fixtures as fx

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


def test_fp8_m2_hub_checkpoint(tmp_path, caplog):
    """FP8 e4m3 + 128x128 scale_inv, hidden 200 (partial tiles), hub names, 3 shards, plus tensors of
    an unpublished MTP slot ``model.layers.2.*`` that must be reported, not dropped silently."""
    hf.require_hf()
    import torch

    model = fx.wide_m2(25)
    extras = {"model.layers.2.self_attn.q_proj.weight": torch.zeros(256, 200),
              "model.layers.2.input_layernorm.weight": torch.ones(200)}
    oracle, tensors = fx.hub_checkpoint(model, str(tmp_path / "hf"), fp8=True, extras=extras)
    assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) >= 14
    with caplog.at_level("WARNING"):
        cfg, report = convert_hf_to_orbax(tmp_path / "hf", tmp_path / "ours", "float32", progress=False)
    assert len(report["warnings"]) == 1 and "layer indices [2]" in report["warnings"][0], report["warnings"]
    assert "layer indices [2]" in caplog.text
    assert report["fp8_tensors_dequantized"] >= 14
    with open(tmp_path / "ours" / "conversion.json") as f:
        assert json.load(f)["warnings"] == report["warnings"]
    _check_logits(oracle, tmp_path / "ours", 25, seq=23)


def test_fp8_m3_vl_hub_checkpoint_with_mtp(tmp_path):
    """M3 hub spelling: ``language_model.`` prefix, ``text_config`` wrapper, ``block_sparse_moe``,
    ``self_attn.index_*``, split shared/dense ``gate_proj``/``up_proj``, FP8 with partial tiles,
    an MTP module under ``model.mtp.layers.0.transformer_layer.`` and a vision tensor (reported)."""
    hf.require_hf()
    import torch

    from minimax_jax.convert.fp8 import dequantize
    from minimax_jax.convert.safetensors_io import SafetensorsReader

    model = fx.wide_m3(26)
    extras = {"vision_tower.vision_model.embeddings.patch_embedding.weight": torch.randn(8, 3, 2, 2)}
    oracle, tensors = fx.hub_checkpoint(model, str(tmp_path / "hf"), fp8=True, mtp=True, extras=extras)
    assert any("index_q_proj" in n for n in tensors) and any("mtp.layers.0.transformer_layer" in n for n in tensors)
    cfg, report = convert_hf_to_orbax(tmp_path / "hf", tmp_path / "ours", "float32", progress=False)
    assert cfg.num_mtp_modules == 1 and cfg.has_msa
    assert len(report["warnings"]) == 1 and "outside the text tower" in report["warnings"][0]
    _, params = _check_logits(oracle, tmp_path / "ours", 26, seq=29)
    # MTP leaves: every one equals the (dequantised) checkpoint tensor in our orientation.
    r = SafetensorsReader(str(tmp_path / "hf"))
    mp = "language_model.model.mtp.layers.0."

    def hf_t(name):
        a = r.read(name)
        return dequantize(a, r.read(name + "_scale_inv")) if name + "_scale_inv" in r else a.astype(np.float32)

    mtp = params["mtp"][0]
    np.testing.assert_array_equal(np.asarray(mtp["eh_proj"]), hf_t(mp + "eh_proj.weight").T)
    np.testing.assert_array_equal(np.asarray(mtp["final_norm"]["scale"]), hf_t(mp + "final_layernorm.weight"))
    lay = mtp["layer"]
    tl = mp + "transformer_layer."
    np.testing.assert_array_equal(np.asarray(lay["attn"]["index_q_proj"]), hf_t(tl + "self_attn.index_q_proj.weight").T)
    np.testing.assert_array_equal(np.asarray(lay["attn"]["q_proj"]), hf_t(tl + "self_attn.q_proj.weight").T)
    I = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        base = tl + f"block_sparse_moe.experts.{e}."
        np.testing.assert_array_equal(np.asarray(lay["mlp"]["wi"][e, :, :I]), hf_t(base + "w1.weight").T)
        np.testing.assert_array_equal(np.asarray(lay["mlp"]["wi"][e, :, I:]), hf_t(base + "w3.weight").T)
        np.testing.assert_array_equal(np.asarray(lay["mlp"]["wo"][e]), hf_t(base + "w2.weight").T)
    Is = cfg.shared_intermediate_size
    np.testing.assert_array_equal(np.asarray(lay["mlp"]["shared_wi"][:, Is:]),
                                  hf_t(tl + "block_sparse_moe.shared_experts.up_proj.weight").T)


def test_cli_converts_and_reports_speed(tmp_path, capsys):
    hf.require_hf()
    from minimax_jax.convert.cli import main

    model = hf.m2_model(27)
    src = fx.saved_pretrained(model, str(tmp_path / "hf"))
    rc = main(["--src", src, "--dst", str(tmp_path / "ours"), "--dtype", "float32", "--no-progress"])
    assert rc == 0
    assert "GB/s" in capsys.readouterr().out
    _check_logits(model, tmp_path / "ours", 27)
