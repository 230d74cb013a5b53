"""FP8 hub-layout checkpoints (e4m3 + 128x128 ``weight_scale_inv``, hidden 200 so edge tiles are
partial) convert to params whose logits equal those of an HF model holding the dequantised
weights (fp32, relative error <= 1e-5); M2 MTP slots and M3 vision tensors are reported."""

import json

import numpy as np

from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx
from tests.convert.test_convert_parity import _check_logits


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
