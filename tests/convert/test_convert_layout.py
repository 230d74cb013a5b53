"""The declarative HF <-> ours layout: every spelling of every slot tiles its leaf exactly once
(so reused unit buffers never keep stale values), slots agree with ``abstract_params``, and the
in-memory name mapping (``hf_names``) round-trips."""

import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.convert import hf_names
from minimax_jax.convert.layout import ALL_STYLES, layer_slots, mtp_layer_prefixes, mtp_slots, top_slots

M3ISH = ModelConfig(vocab_size=50, hidden_size=24, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=4,
                    norm_kind="gemma", qk_norm="per_head", layer_types=("full", "msa", "msa"),
                    mlp_types=("dense", "moe", "moe"), mlp_activation="swigluoai", dense_intermediate_size=20,
                    num_experts=3, num_experts_per_tok=2, moe_intermediate_size=12, shared_intermediate_size=6,
                    index_head_dim=8, index_block_size=4, index_topk=2, num_mtp_modules=2)
M2ISH = ModelConfig(vocab_size=50, hidden_size=24, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, rotary_dim=4,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12)


def _all_slots(cfg):
    out = list(top_slots(cfg))
    for i in range(cfg.num_layers):
        out += layer_slots(cfg, f"model.layers.{i}.", cfg.layer_types[i], cfg.mlp_types[i])
    for i in range(cfg.num_mtp_modules):
        out += mtp_slots(cfg, i, mtp_layer_prefixes(i)[0])
    return out


@pytest.mark.parametrize("cfg", [M2ISH, M3ISH], ids=["m2", "m3"])
def test_every_alternative_tiles_its_leaf_exactly_once(cfg):
    n_alts = 0
    for slot in _all_slots(cfg):
        assert slot.alts
        for alt in slot.alts:
            count = np.zeros(slot.shape, np.int32)
            for p in alt.pieces:
                sub = count[p.dest]
                want = tuple(p.shape[i] for i in (p.perm or range(len(p.shape))))
                assert sub.shape[len(sub.shape) - len(want):] == want, (p.name, sub.shape, want)
                count[p.dest] += 1
            assert (count == 1).all(), (slot.path, [p.name for p in alt.pieces])
            n_alts += 1
        for style in ALL_STYLES:  # every style has a spelling for every slot
            slot.for_style(style)
    assert n_alts > 40


@pytest.mark.parametrize("cfg", [M2ISH, M3ISH], ids=["m2", "m3"])
def test_slots_match_abstract_params(cfg):
    import jax

    from minimax_jax.model.params import abstract_params, layer_segments

    ap = abstract_params(cfg)
    for slot in top_slots(cfg):
        node = ap
        for k in slot.path:
            node = node[k]
        assert tuple(node.shape) == slot.shape, slot.path
    n = 0
    for si, seg in enumerate(layer_segments(cfg)):
        slots = layer_slots(cfg, "x.", seg.layer_type, seg.mlp_type)
        flat = {tuple(getattr(k, "key", k) for k in path): v
                for path, v in jax.tree_util.tree_flatten_with_path(ap["segments"][si])[0]}
        assert {s.path for s in slots} == {tuple(k.key for k in p) for p, _ in
                                           jax.tree_util.tree_flatten_with_path(ap["segments"][si])[0]}
        for s in slots:
            leaf = ap["segments"][si]
            for k in s.path:
                leaf = leaf[k]
            assert tuple(leaf.shape) == (seg.length,) + s.shape, s.path
            n += 1
        assert flat
    assert n >= 12


@pytest.mark.parametrize("cfg, hub", [(M2ISH, True), (M2ISH, False), (M3ISH, True)], ids=["m2hub", "m2native", "m3"])
def test_hf_names_round_trip(cfg, hub):
    """layer_to_hf then layer_from_hf returns the same values; MTP and top-level too."""
    rng = np.random.default_rng(5)
    from minimax_jax.model.params import abstract_params, layer_segments

    ap = abstract_params(cfg)
    for si, seg in enumerate(layer_segments(cfg)):
        import jax

        layer = jax.tree.map(lambda a: rng.standard_normal(a.shape[1:]).astype(np.float32), ap["segments"][si])
        prefix = f"model.layers.{seg.start}."
        hf = hf_names.layer_to_hf(layer, prefix, cfg, seg.layer_type, seg.mlp_type, hub_layout=hub)
        assert sorted(hf) == hf_names.layer_hf_names(cfg, seg.start, hub_layout=hub)
        back = hf_names.layer_from_hf(hf.__getitem__, hf.__contains__, prefix, cfg, seg.layer_type, seg.mlp_type)
        jax.tree.map(np.testing.assert_array_equal, back, layer)
    if cfg.num_mtp_modules:
        import jax

        mod = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), ap["mtp"][1])
        hf = hf_names.mtp_to_hf(mod, cfg, 1)
        assert all(k.startswith("model.mtp.layers.1.") for k in hf)
        assert "model.mtp.layers.1.transformer_layer.self_attn.q_proj.weight" in hf
        jax.tree.map(np.testing.assert_array_equal, hf_names.mtp_from_hf(hf.__getitem__, hf.__contains__, cfg, 1), mod)
        # older exports put the layer under mtp_block.: still read
        old = {k.replace(".transformer_layer.", ".mtp_block."): v for k, v in hf.items()}
        jax.tree.map(np.testing.assert_array_equal, hf_names.mtp_from_hf(old.__getitem__, old.__contains__, cfg, 1), mod)


def test_missing_tensor_message_names_it():
    with pytest.raises(hf_names.MissingTensorError, match=r"model\.layers\.0\.input_layernorm\.weight"):
        hf_names.layer_from_hf(lambda n: None, lambda n: False, "model.layers.0.", M2ISH, "full", "moe")
