"""ModelConfig loading and validation."""

import json
import subprocess
import sys

import pytest

from minimax_jax.config import ConfigError, ModelConfig, load_config
from minimax_jax.model import abstract_params, count_params
from minimax_jax.ops import registry
from tests.paths import REPO_ROOT


def test_real_m2_config_builds_abstractly_with_documented_counts(capsys):
    cfg = load_config("minimax-m2")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (3072, 62, 48, 8)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (256, 8, 200064)
    ap = abstract_params(cfg)  # jax.eval_shape: nothing is allocated
    total = count_params(ap)
    counts = cfg.param_counts()
    print(f"MiniMax-M2: total {total / 1e9:.2f}B, active per token {counts['active_non_embedding'] / 1e9:.2f}B "
          f"(non-embedding; {counts['active'] / 1e9:.2f}B with embedding and lm_head)")
    assert total == counts["total"]
    assert 228e9 < total < 230e9          # ~229B documented
    assert 9.7e9 < counts["active_non_embedding"] < 9.9e9   # ~9.8B documented
    seg = ap["segments"][0]
    assert seg["mlp"]["wi"].shape == (62, 256, 3072, 2 * 1536)
    assert seg["attn"]["q_norm"]["scale"].shape == (62, 6144)


def test_real_m3_config_builds_abstractly():
    cfg = load_config("minimax-m3")
    assert cfg.layer_types[:3] == ("full",) * 3 and set(cfg.layer_types[3:]) == {"msa"}
    assert cfg.mlp_types[:3] == ("dense",) * 3 and set(cfg.mlp_types[3:]) == {"moe"}
    ap = abstract_params(cfg)
    assert count_params(ap) == cfg.param_counts()["total"]
    assert ap["segments"][1]["attn"]["index_q_proj"].shape == (57, 6144, 4 * 128)
    assert len(ap["mtp"]) == 7


@pytest.mark.parametrize("bad, field", [
    (dict(num_heads=6, num_kv_heads=4), "num_heads"),
    (dict(rotary_dim=20, head_dim=16), "rotary_dim"),
    (dict(rotary_dim=3), "rotary_dim"),
    (dict(num_experts_per_tok=9, num_experts=8), "num_experts_per_tok"),
    (dict(layer_types=("full", "bogus")), "layer_types"),
    (dict(norm_kind="layer"), "norm_kind"),
    (dict(hidden_size=-1), "hidden_size"),
])
def test_inconsistent_fields_name_the_field(bad, field):
    base = dict(vocab_size=32, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=4,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8)
    base.update(bad)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(base)


def test_unknown_field_is_rejected_with_valid_list():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['hiden_size'\]"):
        ModelConfig.from_dict({"hiden_size": 3})


def test_hf_config_both_rope_styles(tmp_path):
    hub = {"model_type": "minimax_m2", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8,
           "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8}
    native = dict(hub)
    del native["rotary_dim"]
    native["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(native))
    a = ModelConfig.from_hf_config(hub)
    b = ModelConfig.from_hf_config(tmp_path)
    assert a.rotary_dim == b.rotary_dim == 8
    assert b.rope_theta == 1e6 and a.rope_theta == 5e6
    full = dict(native, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert ModelConfig.from_hf_config(full).rotary_dim == 16  # partial_rotary_factor defaults to 1.0


def test_hf_config_roundtrip_m3():
    cfg = load_config("tiny-m3")
    back = ModelConfig.from_hf_config(cfg.to_hf_config(), dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    for f in ("layer_types", "mlp_types", "index_topk", "index_block_size", "shared_intermediate_size",
              "routed_scaling_factor", "norm_kind", "qk_norm", "mlp_activation", "rotary_dim", "num_mtp_modules"):
        assert getattr(back, f) == getattr(cfg, f), f


def test_with_msa_turns_chosen_layers_sparse():
    cfg = load_config("tiny-m2")
    m = cfg.with_msa([1, 2], index_block_size=8, index_topk=2, index_head_dim=16)
    assert m.layer_types == ("full", "msa", "msa") and m.index_num_heads == cfg.num_kv_heads
    with pytest.raises(ConfigError, match="out of range"):
        cfg.with_msa([7])


def test_missing_config_name():
    with pytest.raises(ConfigError, match="no config file"):
        load_config("no-such-model")


def test_importing_and_loading_a_config_does_not_import_jax():
    """minimax_jax.convert reads configs without jax: the registry is imported only to check a name
    other than "auto"."""
    code = ("import sys, minimax_jax.config as c; assert 'jax' not in sys.modules; c.load_config('minimax-m2'); "
            "assert 'jax' not in sys.modules, 'load_config imported jax'; c.load_config('tiny-m2').replace("
            "moe_impl='xla_ragged'); assert 'jax' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_an_unknown_implementation_is_a_one_line_error_listing_the_registered_names():
    cfg = load_config("tiny-m2")
    for field, op in (("attention_impl", "attention"), ("sliding_attention_impl", "attention"),
                      ("moe_impl", "moe"), ("msa_impl", "msa_attention")):
        with pytest.raises(ConfigError) as e:
            cfg.replace(**{field: "cuda"})
        assert str(e.value) == f"{field} must be one of {registry.implementation_names(op)}, got 'cuda'"
    with pytest.raises(ConfigError, match=r"got 'dense' \('dense' was renamed to xla_dense\)$"):
        ModelConfig.from_dict({"moe_impl": "dense"})


def test_malformed_model_yaml_is_one_config_error_line(tmp_path):
    """A checkpoint's broken config.yaml (or a non-UTF-8 one) is a ConfigError naming the file and the place."""
    from minimax_jax.config import ConfigError, ModelConfig
    bad = tmp_path / "config.yaml"
    bad.write_text("model: [unclosed\n  x: : :\n")
    with pytest.raises(ConfigError, match=r"config.yaml: not valid YAML \(line 2, column 4\)") as e:
        ModelConfig.from_yaml(bad)
    assert "\n" not in str(e.value)
    bad.write_bytes(b"\xff\xfe\x00model: 1")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        ModelConfig.from_yaml(bad)
