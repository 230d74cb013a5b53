"""Conversion keeping FP8 (``weights_dtype="fp8"``) of the hub-layout FP8 fixtures (e4m3 + 128x128 scales,
quantised by torch in ``test_convert_fixtures``; hidden 200 / expert width 136, so tiles are partial and the
fused gate | up columns meet off a 128 boundary): the kept leaves dequantise exactly to the dequantising
conversion's, the logits match the dequantised model and the HF oracle, the expert leaves take about half
the bytes of bfloat16, export writes the source FP8 bytes back bit for bit, and bad combinations fail."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from minimax_jax.convert.errors import CheckpointError, TensorDtypeError
from minimax_jax.convert.export import export_orbax_to_hf
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from minimax_jax.convert.load import load_checkpoint
from minimax_jax.convert.safetensors_io import SafetensorsReader
from minimax_jax.model import forward
from minimax_jax.model.fp8_params import fp8_blocks, leaf_bytes
from minimax_jax.ops.moe import Fp8Weight
from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx

_fwd = jax.jit(lambda p, t, cfg: forward(p, cfg, t).logits, static_argnums=2)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - b)) / np.max(np.abs(b)))


def _convert(kind, root):
    hf.require_hf()
    model = fx.wide_m2(25) if kind == "m2" else fx.wide_m3(26)
    oracle, tensors = fx.hub_checkpoint(model, str(root / "hf"), fp8=True, mtp=kind == "m3")
    convert_hf_to_orbax(root / "hf", root / "deq", "float32", progress=False)
    cfg, report = convert_hf_to_orbax(root / "hf", root / "keep", "float32", progress=False, weights_dtype="fp8")
    return dict(root=root, oracle=oracle, tensors=tensors, cfg=cfg, report=report)


@pytest.fixture(scope="module")
def m2(tmp_path_factory):
    return _convert("m2", tmp_path_factory.mktemp("m2"))


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    return _convert("m3", tmp_path_factory.mktemp("m3"))


def _check_model(c, expect_blocks, impls=("auto",)):
    root, cfg = c["root"], c["cfg"]
    with open(root / "keep" / "fp8_weights.json") as f:
        blocks = {k: tuple(v) for k, v in json.load(f)["blocks"].items()}
    for name, block in expect_blocks.items():
        assert blocks[name] == block, (name, blocks.get(name))
    assert c["report"]["fp8_tensors_kept"] == sum(t.dtype == hf.torch.float8_e4m3fn for t in c["tensors"].values())
    assert c["report"]["fp8_tensors_dequantized"] == 0
    _, deq = load_checkpoint(root / "deq")
    _, kept = load_checkpoint(root / "keep", weights_dtype="fp8")
    assert fp8_blocks(kept) == blocks
    # every kept leaf is e4m3 + f32 scales and dequantises exactly to the dequantising conversion's leaf
    flat_d = dict(jax.tree_util.tree_flatten_with_path(deq)[0])
    flat_k = jax.tree_util.tree_flatten_with_path(kept, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]
    assert len(flat_k) == len(flat_d)
    for path, leaf in flat_k:
        if isinstance(leaf, Fp8Weight):
            assert leaf.w.dtype == jnp.float8_e4m3fn and leaf.scale_inv.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(leaf.astype(jnp.float32)), np.asarray(flat_d[path]))
        else:
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat_d[path]))
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 29)).astype(np.int32)
    ref = hf.hf_logits(c["oracle"], tokens)   # the HF model holding the dequantised weights
    for impl in impls:
        assert _rel(_fwd(kept, jnp.asarray(tokens), cfg.replace(moe_impl=impl)), ref) <= 1e-5, impl
    return deq, kept


def _check_bf16(c, tol_vs_f32):
    """bf16 compute on the FP8 weights (what inference runs) equals the bf16 model of the dequantised weights
    (the same bf16 values: dequantised in f32, rounded once) and lies within ``tol_vs_f32`` of the f32 logits
    (M2 only: M3's MSA block choice is discrete, so bf16 rounding can move whole blocks)."""
    root, cfg = c["root"], c["cfg"]
    c16 = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 21)).astype(np.int32))
    _, kept16 = load_checkpoint(root / "keep", weights_dtype="fp8", dtype="bfloat16")
    _, deq16 = load_checkpoint(root / "deq", dtype="bfloat16")
    got = _fwd(kept16, tokens, c16)
    assert _rel(got, np.asarray(_fwd(deq16, tokens, c16))) <= 1e-6
    _, deq = load_checkpoint(root / "deq")
    assert _rel(got, np.asarray(_fwd(deq, tokens, cfg))) <= tol_vs_f32


def test_m2_kept_fp8_matches_dequantised_model(m2):
    E = ("segments.0.mlp.wi", "segments.0.mlp.wo")
    expect = {f"segments.0.attn.{n}_proj": (128, 128) for n in "qkvo"}
    expect.update({E[0]: (128, 8), E[1]: (128, 128)})   # gate | up meet at column 136: gcd(128, 136) = 8
    _, kept = _check_model(m2, expect, impls=("auto", "xla_ragged"))
    _check_bf16(m2, 3e-2)
    # loading the kept checkpoint without weights_dtype dequantises it: the same params as the other conversion
    _, deq = load_checkpoint(m2["root"] / "deq")
    _, back = load_checkpoint(m2["root"] / "keep")
    for a, b in zip(jax.tree.leaves(deq), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wi = kept["segments"][0]["mlp"]["wi"]
    L, En, H, I2 = wi.shape
    assert wi.scale_inv.shape == (L, En, 2, I2 // 8)


def test_m3_kept_fp8_matches_dequantised_model_mtp_index_shared(m3):
    cfg = m3["cfg"]
    assert cfg.num_mtp_modules == 1
    _, kept = _check_model(m3, {"segments.0.mlp.wi": (128, 16),        # dense MLP width 144: gcd(128, 144)
                                "segments.1.mlp.shared_wi": (128, 8),  # shared width 72
                                "segments.1.attn.index_q_proj": (128, 128),
                                "mtp.0.layer.mlp.wi": (128, 8), "mtp.0.layer.mlp.wo": (128, 128)})
    assert isinstance(kept["mtp"][0]["layer"]["attn"]["q_proj"], Fp8Weight)
    assert not isinstance(kept["embed"]["embedding"], Fp8Weight) and not isinstance(kept["lm_head"], Fp8Weight)


def test_expert_bytes_about_half_of_bf16(m2, tmp_path):
    """Measured on the loaded arrays: FP8 expert leaves (e4m3 + scales) vs the same leaves converted to bf16."""
    convert_hf_to_orbax(m2["root"] / "hf", tmp_path / "bf16", "bfloat16", progress=False)
    _, p16 = load_checkpoint(tmp_path / "bf16")
    _, p8 = load_checkpoint(m2["root"] / "keep", weights_dtype="fp8", dtype="bfloat16")
    experts = {"segments.0.mlp.wi", "segments.0.mlp.wo"}
    b8, b16 = leaf_bytes(p8, experts), leaf_bytes(p16, experts)
    assert 0.5 < b8 / b16 < 0.51, (b8, b16)
    assert b8 == sum(x.w.size + 4 * x.scale_inv.size for x in
                     (p8["segments"][0]["mlp"]["wi"], p8["segments"][0]["mlp"]["wo"]))


def test_export_round_trip_is_bit_exact(m2, tmp_path):
    """Kept FP8 -> ``export --fp8``: every FP8 tensor and scale of the source comes back bit for bit; without
    ``fp8`` the export holds the dequantised values."""
    export_orbax_to_hf(m2["root"] / "keep", tmp_path / "hf8", fp8=True, progress=False)
    src, out = SafetensorsReader(str(m2["root"] / "hf")), SafetensorsReader(str(tmp_path / "hf8"))
    n = 0
    for name, t in m2["tensors"].items():
        if t.dtype == hf.torch.float8_e4m3fn:
            n += 1
            assert out.read(name).tobytes() == src.read(name).tobytes(), name
            np.testing.assert_array_equal(out.read(name + "_scale_inv"), src.read(name + "_scale_inv"), err_msg=name)
    assert n >= 14
    export_orbax_to_hf(m2["root"] / "keep", tmp_path / "hf32", progress=False)
    plain = SafetensorsReader(str(tmp_path / "hf32"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    from minimax_jax.convert.fp8 import dequantize

    np.testing.assert_array_equal(plain.read(name), dequantize(src.read(name), src.read(name + "_scale_inv")))
    assert out.read(name).dtype == ml_dtypes.float8_e4m3fn and name + "_scale_inv" not in plain


def test_bad_combinations(m2, tmp_path):
    hf.require_hf()
    fx.hub_checkpoint(fx.wide_m2(27), str(tmp_path / "bf16hf"), fp8=False)
    with pytest.raises(TensorDtypeError, match=r"weights_dtype='fp8': .* has no FP8 .* layer weights"):
        convert_hf_to_orbax(tmp_path / "bf16hf", tmp_path / "never", progress=False, weights_dtype="fp8")
    assert not (tmp_path / "never").exists()
    with pytest.raises(CheckpointError, match=r"holds no FP8 weights \(no fp8_weights.json\)"):
        load_checkpoint(m2["root"] / "deq", weights_dtype="fp8")
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        load_checkpoint(m2["root"] / "keep", weights_dtype="fp16")


@pytest.mark.parametrize("name,gb16,gb8", [("minimax-m2", 457.5, 230.1), ("minimax-m3", 957.3, 481.3)])
def test_published_models_fp8_bytes(name, gb16, gb8):
    """The published configs' params (abstract, nothing allocated) with every layer linear weight FP8 (as the hub
    stores them; 128x128 scales) vs all-bf16: M2 230.1 GB vs 457.5 GB; the MLP / expert leaves alone 0.5 + 2 / 128^2
    of bf16 (a 4-byte scale per 128x128 tile)."""
    from minimax_jax.config import ModelConfig
    from minimax_jax.model.fp8_params import leaf_name, quantized_abstract
    from minimax_jax.model.params import abstract_params
    from tests.paths import REPO_ROOT

    cfg = ModelConfig.from_yaml(os.path.join(REPO_ROOT, "configs", f"{name}.yaml")).replace(param_dtype="bfloat16")
    dense = abstract_params(cfg)
    names = [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(dense)[0]]
    layer = [n for n in names if n.split(".")[0] in ("segments", "mtp") and n.endswith(
        ("_proj", "mlp.wi", "mlp.wo", "shared_wi", "shared_wo"))]
    q = quantized_abstract(dense, {n: (128, 128) for n in layer})
    assert round(leaf_bytes(dense) / 1e9, 1) == gb16 and round(leaf_bytes(q) / 1e9, 1) == gb8
    moe = {n for n in layer if n.endswith(("mlp.wi", "mlp.wo"))}
    assert leaf_bytes(q, moe) / leaf_bytes(dense, moe) == pytest.approx(0.5 + 2 / 128 ** 2, rel=1e-3)


def test_cli_weights_dtype(m2, tmp_path, capsys):
    """``--weights_dtype fp8`` keeps FP8 (exit 0); with ``--export`` it is refused with one line (exit 2)."""
    from minimax_jax.convert.cli import main

    assert main(["--src", str(m2["root"] / "hf"), "--dst", str(tmp_path / "k"), "--weights_dtype", "fp8",
                 "--no_progress"]) == 0
    assert (tmp_path / "k" / "fp8_weights.json").is_file()
    assert main(["--src", str(tmp_path / "k"), "--dst", str(tmp_path / "e"), "--export", "--weights_dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("python -m minimax_jax.convert: error: "
                                                                       "--weights_dtype applies to HF -> orbax")
