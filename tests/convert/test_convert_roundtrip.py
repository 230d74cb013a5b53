"""safetensors -> orbax -> safetensors: BF16 round trips are bit-identical (names, dtypes, bytes);
FP8 re-quantisation reproduces the hub format; exports load in HF transformers."""

import json
import os

import numpy as np
import pytest

from minimax_jax.convert.export import export_orbax_to_hf
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from minimax_jax.convert.safetensors_io import SafetensorsReader
from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx


def _native_bf16_checkpoint(model, d):
    """transformers-native names (what M3 loads), BF16 except float32 router gate / bias."""
    import torch

    tensors = {}
    for k, v in model.state_dict().items():
        keep32 = k.endswith(".gate.weight") or "e_score_correction_bias" in k
        tensors[k] = v.detach().float() if keep32 else v.detach().to(torch.bfloat16)
    os.makedirs(d, exist_ok=True)
    fx.write_shards(tensors, d, 4)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f, default=str)
    fx.write_side_files(d)
    return tensors


def _assert_same_checkpoint(a_dir, b_dir):
    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        ia, ib = a.info(n), b.info(n)
        assert (ia.dtype, ia.shape) == (ib.dtype, ib.shape), n
        assert a.read(n).tobytes() == b.read(n).tobytes(), n


def _hf_logits_equal(cls, dir_a, dir_b, vocab):
    import torch

    ma = cls.from_pretrained(dir_a, dtype=torch.float32).eval()
    mb, info = cls.from_pretrained(dir_b, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = np.random.default_rng(0).integers(0, vocab, (1, 13))
    np.testing.assert_array_equal(hf.hf_logits(ma, tokens), hf.hf_logits(mb.eval(), tokens))


def test_m2_hub_bf16_round_trip_bit_identical(tmp_path):
    hf.require_hf()
    import torch
    import transformers

    model = fx.wide_m2(31)
    fx.hub_checkpoint(model, str(tmp_path / "src"), fp8=False, dtype=torch.bfloat16)
    convert_hf_to_orbax(tmp_path / "src", tmp_path / "ours", "bfloat16", progress=False)
    out = export_orbax_to_hf(tmp_path / "ours", tmp_path / "back", max_shard_bytes=60_000, progress=False)
    assert out["shards"] >= 3
    _assert_same_checkpoint(str(tmp_path / "src"), str(tmp_path / "back"))
    with open(tmp_path / "back" / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = {fn for fn in os.listdir(tmp_path / "back") if fn.endswith(".safetensors")}
    assert set(index["weight_map"].values()) == files and len(files) == out["shards"]
    assert index["metadata"]["total_size"] == sum(SafetensorsReader(str(tmp_path / "back")).info(n).nbytes
                                                  for n in index["weight_map"])
    for n in fx.SIDE_FILES:
        with open(tmp_path / "back" / n) as f:
            assert f.read() == fx.SIDE_FILES[n]
    _hf_logits_equal(transformers.MiniMaxM2ForCausalLM, tmp_path / "src", tmp_path / "back", 97)


def test_m3_native_bf16_round_trip_bit_identical_and_loads_in_hf(tmp_path):
    hf.require_hf()
    import transformers

    model = hf.m3_model(32)
    _native_bf16_checkpoint(model, str(tmp_path / "src"))
    convert_hf_to_orbax(tmp_path / "src", tmp_path / "ours", "bfloat16", progress=False)
    export_orbax_to_hf(tmp_path / "ours", tmp_path / "back", progress=False)
    _assert_same_checkpoint(str(tmp_path / "src"), str(tmp_path / "back"))
    _hf_logits_equal(transformers.MiniMaxM3VLForCausalLM, tmp_path / "src", tmp_path / "back", 97)


@pytest.mark.parametrize("kind", ["m2", "m3"])
def test_fp8_hub_round_trip_reproduces_the_source(tmp_path, kind):
    """FP8 source -> float32 orbax -> FP8 export: every FP8 weight and scale equals the source's.
    (Dequantised values re-quantise to the same codes because each tile's max maps back to 448.)"""
    hf.require_hf()
    model = fx.wide_m2(33) if kind == "m2" else fx.wide_m3(33)
    _, tensors = fx.hub_checkpoint(model, str(tmp_path / "src"), fp8=True)
    convert_hf_to_orbax(tmp_path / "src", tmp_path / "ours", "float32", progress=False)
    export_orbax_to_hf(tmp_path / "ours", tmp_path / "back", fp8=True, progress=False)
    src, back = SafetensorsReader(str(tmp_path / "src")), SafetensorsReader(str(tmp_path / "back"))
    with open(tmp_path / "back" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["weight_block_size"] == [128, 128] and qc["fmt"] == "float8_e4m3fn"
    n = 0
    for name in src.names():
        if src.info(name).dtype != "F8_E4M3":
            continue
        # M2 exports keep hub names; M3 exports use transformers-native names (fused experts), so
        # compare M3 through the tensors that keep their spelling (attention projections).
        ours = name[len("language_model."):] if name.startswith("language_model.") else name
        if ours not in back:
            assert kind == "m3", name
            continue
        n += 1
        assert back.info(ours).dtype == "F8_E4M3"
        assert back.read(ours).tobytes() == src.read(name).tobytes(), name
        np.testing.assert_array_equal(back.read(ours + "_scale_inv"), src.read(name + "_scale_inv"), err_msg=name)
    assert n >= (14 if kind == "m2" else 8)


def test_cli_export_fp8(tmp_path, capsys):
    hf.require_hf()
    from minimax_jax.convert.cli import main

    model = fx.wide_m2(35)
    src = fx.saved_pretrained(model, str(tmp_path / "hf"))
    assert main(["--src", src, "--dst", str(tmp_path / "ours"), "--no-progress", "--in-flight", "1"]) == 0
    assert main(["--export", "--fp8", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "back"),
                 "--no-progress", "--max-shard-gb", "0.0001"]) == 0
    assert "shard(s)" in capsys.readouterr().out
    back = SafetensorsReader(str(tmp_path / "back"))
    names = set(back.names())
    assert "model.layers.1.block_sparse_moe.experts.2.w2.weight_scale_inv" in names
    assert back.info("model.layers.0.self_attn.q_proj.weight").dtype == "F8_E4M3"
    assert back.info("model.layers.0.block_sparse_moe.gate.weight").dtype == "F32"
    assert back.info("lm_head.weight").dtype == "BF16"
    assert len({os.path.basename(i.path) for i in back.infos.values()}) >= 5
    # the FP8 export converts again (our reader dequantises it) to the same architecture
    cfg, rep = convert_hf_to_orbax(tmp_path / "back", tmp_path / "again", "float32", progress=False)
    assert rep["fp8_tensors_dequantized"] > 0 and cfg.hidden_size == 200


def test_export_refuses_existing_destination(tmp_path):
    hf.require_hf()
    model = hf.m2_model(34)
    src = fx.saved_pretrained(model, str(tmp_path / "hf"))
    convert_hf_to_orbax(src, tmp_path / "ours", "float32", progress=False)
    os.makedirs(tmp_path / "back")
    with pytest.raises(FileExistsError, match="already exists"):
        export_orbax_to_hf(tmp_path / "ours", tmp_path / "back", progress=False)
    assert os.listdir(tmp_path / "back") == []
    export_orbax_to_hf(tmp_path / "ours", tmp_path / "back", progress=False, overwrite=True)
    assert "config.json" in os.listdir(tmp_path / "back")
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_export_with_relative_paths(tmp_path, monkeypatch):
    """Relative --src / --dst (README's own example): orbax gives no item metadata for a relative
    directory, so the exporter must resolve it first."""
    hf.require_hf()
    from minimax_jax.convert.cli import main

    src = fx.saved_pretrained(hf.m2_model(36), str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    assert main(["--src", os.path.relpath(src, tmp_path), "--dst", "ours", "--no-progress"]) == 0
    assert main(["--export", "--src", "ours", "--dst", "back", "--no-progress"]) == 0
    assert "model.layers.0.self_attn.q_proj.weight" in set(SafetensorsReader(str(tmp_path / "back")).names())
