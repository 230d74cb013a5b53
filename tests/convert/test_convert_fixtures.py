"""Checkpoint fixtures for the conversion tests, built by the real libraries (transformers models,
``save_pretrained``, ``safetensors.torch``), plus tests of the fixtures themselves.

- ``saved_pretrained``: a tiny random HF model written by ``save_pretrained`` in several shards.
- ``hub_checkpoint``: the same weights re-spelled in the published hub layout (M2: per-expert
  ``block_sparse_moe.experts.N.w1/w3/w2``; M3: ``language_model.`` prefix, ``block_sparse_moe``,
  ``index_*``, split ``gate_proj/up_proj``, MTP under ``model.mtp.layers.0.transformer_layer.``),
  optionally FP8 e4m3 + 128x128 ``weight_scale_inv`` quantised HERE WITH TORCH (independent of
  ``minimax_jax.convert.fp8``), sharded with an index json. Returns the HF model holding the
  dequantised weights, the numerical oracle for FP8 checkpoints.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from tests import hf_fixtures as hf

torch = hf.torch
BLOCK = 128

# hidden 200 / head_dim 64 / expert width 136: several tensors have partial 128x128 edge tiles.
M2_WIDE = dict(vocab=97, hidden=200, inter=136, layers=2, heads=4, kv=2, head_dim=64, rotary_dim=32, experts=3,
               top_k=2)
M3_WIDE = dict(vocab=97, hidden=200, inter=136, heads=4, kv=2, head_dim=64, rotary_dim=32, experts=3, top_k=2,
               dense_inter=144, shared_inter=72, index_dim=64, block=8, topk_blocks=3)
SIDE_FILES = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
              "tokenizer_config.json": '{"model_max_length": 1024}',
              "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}"}


def is_m3(model) -> bool:
    return "m3" in type(model).__name__.lower()


def write_side_files(d: str) -> None:
    for n, text in SIDE_FILES.items():
        with open(os.path.join(d, n), "w") as f:
            f.write(text)


def saved_pretrained(model, d: str, *, max_shard_size="20KB", dtype=None) -> str:
    """``model.save_pretrained(d)`` sharded; returns ``d``."""
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(d, max_shard_size=max_shard_size)
    write_side_files(d)
    return d


# ----------------------------------------------------------------------------- hub spelling
def hub_entries(model) -> list[tuple[str, str, tuple]]:
    """``(hub_name, native_state_key, index)``: hub tensor = native_state[key][index]."""
    sd = model.state_dict()
    cfg = model.config
    I = cfg.intermediate_size
    m3 = is_m3(model)
    pre = "language_model." if m3 else ""
    out = []
    for k, v in sd.items():
        m = re.match(r"(model\.layers\.\d+\.)(.*)$", k)
        if not m:
            out.append((pre + k, k, ()))
            continue
        p, rest = m.groups()
        if rest == "mlp.experts.gate_up_proj":
            for e in range(v.shape[0]):
                out.append((f"{pre}{p}block_sparse_moe.experts.{e}.w1.weight", k, (e, slice(0, I))))
                out.append((f"{pre}{p}block_sparse_moe.experts.{e}.w3.weight", k, (e, slice(I, 2 * I))))
        elif rest == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out.append((f"{pre}{p}block_sparse_moe.experts.{e}.w2.weight", k, (e,)))
        elif rest == "mlp.gate.weight":
            out.append((f"{pre}{p}block_sparse_moe.gate.weight", k, ()))
        elif rest in ("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias"):
            out.append((f"{pre}{p}block_sparse_moe.e_score_correction_bias", k, ()))
        elif rest.endswith("gate_up_proj.weight"):  # M3 dense MLP or shared expert: split gate / up
            base = rest[:-len("gate_up_proj.weight")].replace("mlp.shared_experts.", "block_sparse_moe.shared_experts.")
            n = v.shape[0] // 2
            out.append((f"{pre}{p}{base}gate_proj.weight", k, (slice(0, n),)))
            out.append((f"{pre}{p}{base}up_proj.weight", k, (slice(n, 2 * n),)))
        elif rest.startswith("mlp.shared_experts."):
            out.append((f"{pre}{p}{rest.replace('mlp.shared_experts.', 'block_sparse_moe.shared_experts.')}", k, ()))
        elif rest.startswith("self_attn.indexer."):
            out.append((f"{pre}{p}self_attn.index_{rest[len('self_attn.indexer.'):]}", k, ()))
        else:
            out.append((pre + k, k, ()))
    return out


def quantizable(hub_name: str) -> bool:
    """Layer linear weights are FP8 in the hub; router, norms, embedding, lm_head are not."""
    return (".layers." in hub_name and hub_name.endswith(".weight") and
            (hub_name.endswith("_proj.weight") or re.search(r"\.w[123]\.weight$", hub_name) is not None))


def quantize_torch(w):
    """Block FP8 with torch: scale = amax(tile)/448 (1 for an all-zero tile); q = e4m3(w/scale)."""
    r, c = w.shape
    sr, sc = -(-r // BLOCK), -(-c // BLOCK)
    scale = torch.ones(sr, sc, dtype=torch.float32)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            t = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            amax = t.abs().max()
            s = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (t / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_torch(q, scale):
    r, c = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
    return q.float() * full


def write_shards(tensors: dict, d: str, n_shards: int) -> None:
    """``safetensors.torch.save_file`` into ``n_shards`` files + ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    groups = [names[i::n_shards] for i in range(n_shards)]
    weight_map = {}
    for k, g in enumerate(groups):
        fn = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in g}, os.path.join(d, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in g})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def hub_checkpoint(model, d: str, *, fp8: bool, n_shards: int = 3, dtype=None, mtp: bool = False,
                   extras: dict | None = None):
    """Write ``model``'s weights in the hub layout (see module docstring) into ``d``.

    Args:
      fp8: quantise the layer linear weights (torch, 128x128 blocks) and write ``weight_scale_inv``.
      dtype: torch dtype of the unquantised tensors (default float32); router gate and correction
        bias are always float32, as in the hub.
      mtp: (M3) add one MTP module with random weights and ``num_mtp_modules: 1`` in the config.
      extras: more tensors to add verbatim (name -> torch tensor).
    Returns: ``(oracle_model, tensors)``: an HF model of the same class holding exactly the weights
      the checkpoint encodes (dequantised), and the dict of written tensors.
    """
    sd = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    tensors = {}
    for hub, key, idx in hub_entries(model):
        t = sd[key][idx].contiguous() if idx else sd[key].contiguous()
        if fp8 and quantizable(hub):
            q, s = quantize_torch(t)
            tensors[hub], tensors[hub + "_scale_inv"] = q, s
            t = dequantize_torch(q, s)
        elif ".gate.weight" in hub or "e_score_correction_bias" in hub:
            tensors[hub] = t.float()
        else:
            tensors[hub] = t.to(dtype) if dtype is not None else t
            t = tensors[hub].float()
        if idx:
            sd[key][idx] = t
        else:
            sd[key] = t
    cfg = model.config.to_dict()
    if mtp:
        g = torch.Generator().manual_seed(7)
        last = model.config.num_hidden_layers - 1
        lp = f"language_model.model.layers.{last}."
        mp = "language_model.model.mtp.layers.0."
        H = model.config.hidden_size
        for n in [n for n in list(tensors) if n.startswith(lp)]:
            v = tensors[n]
            if v.dtype == torch.float8_e4m3fn:
                v = (torch.randn(v.shape, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
            elif n.endswith("_scale_inv"):
                v = torch.rand(v.shape, generator=g) * 0.01
            else:
                v = (torch.randn(v.shape, generator=g) * 0.1).to(v.dtype)
            tensors[mp + "transformer_layer." + n[len(lp):]] = v
        for n, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("final_layernorm.weight", (H,)),
                         ("eh_proj.weight", (H, 2 * H))):
            tensors[mp + n] = torch.randn(shape, generator=g) * 0.1
        cfg["num_mtp_modules"] = 1
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic",
                                      "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    if is_m3(model):
        cfg = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3VLForConditionalGeneration"],
               "text_config": cfg}
    tensors.update(extras or {})
    os.makedirs(d, exist_ok=True)
    write_shards(tensors, d, n_shards)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, default=str)
    write_side_files(d)
    oracle = type(model)(model.config).eval()
    oracle.load_state_dict(sd)
    return oracle, tensors


def wide_m2(seed: int):
    return hf.m2_model(seed, **M2_WIDE)


def wide_m3(seed: int):
    return hf.m3_model(seed, **M3_WIDE)


# ----------------------------------------------------------------------------- fixture checks
def test_fp8_fixture_has_partial_tiles_and_our_dequantisation_matches_torch(tmp_path):
    """Every FP8 tensor of the fixture dequantises identically with torch and with our reader."""
    hf.require_hf()
    from minimax_jax.convert.fp8 import dequantize
    from minimax_jax.convert.safetensors_io import SafetensorsReader

    _, tensors = hub_checkpoint(wide_m2(11), str(tmp_path), fp8=True)
    r = SafetensorsReader(str(tmp_path))
    n = partial = 0
    for name, t in tensors.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        n += 1
        partial += any(s % BLOCK for s in t.shape)
        ours = dequantize(r.read(name), r.read(name + "_scale_inv"), name=name)
        ref = dequantize_torch(t, tensors[name + "_scale_inv"]).numpy()
        np.testing.assert_array_equal(ours, ref, err_msg=name)
    assert n >= 14 and partial >= 10, (n, partial)


def test_reader_returns_every_tensor_bit_exact(tmp_path):
    """All dtypes the fixtures use (F32, BF16, F8_E4M3) come back bit-identical, whole or by rows."""
    hf.require_hf()
    from minimax_jax.convert.safetensors_io import SafetensorsReader

    _, tensors = hub_checkpoint(wide_m2(12), str(tmp_path), fp8=True, dtype=torch.bfloat16)
    r = SafetensorsReader(str(tmp_path))
    assert set(r.names()) == set(tensors)
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype.itemsize == 1 else \
            t.contiguous().view(torch.int16 if t.dtype.itemsize == 2 else torch.int32).numpy().tobytes()
        assert r.read(name).tobytes() == raw, name
        if t.ndim >= 2 and t.shape[0] > 3:
            rows = r.read(name, slice(1, 3)).tobytes()
            assert rows == raw[len(raw) // t.shape[0]:3 * len(raw) // t.shape[0]], name


def test_our_fp8_quantiser_matches_torch_fixture_quantiser():
    """Our export quantiser and the fixtures' torch one agree bit for bit (partial tiles included)."""
    hf.require_hf()
    from minimax_jax.convert.fp8 import quantize

    rng = np.random.default_rng(3)
    for shape in [(200, 136), (136, 200), (128, 128), (5, 300), (257, 129)]:
        w = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
        w[:2, :2] = 0.0
        q, s = quantize(w)
        tq, ts = quantize_torch(torch.tensor(w))
        np.testing.assert_array_equal(s, ts.numpy())
        assert q.tobytes() == tq.view(torch.uint8).numpy().tobytes(), shape


def test_fp8_zero_tile_and_extremes():
    from minimax_jax.convert.fp8 import FP8_MAX, dequantize, quantize, scale_shape

    w = np.zeros((130, 260), np.float32)
    w[129, 259] = -1e6
    w[0, 0] = 3.0
    q, s = quantize(w)
    assert s.shape == scale_shape(w.shape) == (2, 3)
    assert s[0, 1] == 1.0  # all-zero tile
    back = dequantize(q, s)
    assert back[129, 259] == -1e6 and back[0, 0] == 3.0
    assert np.abs(q.astype(np.float32)).max() == FP8_MAX
    with pytest.raises(Exception, match=r"'w_scale_inv'.*expected shape \[2, 3\].*got \[2, 2\]"):
        dequantize(q, s[:, :2], name="w")
