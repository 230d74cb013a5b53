"""Training config: overrides, unknown keys, bad values fail before anything is compiled."""

import os
import time

import pytest

from minimax_jax.train.config import TrainConfigError, apply_overrides, from_dict, load_train_config, validate_against
from minimax_jax.train.model_init import model_configs
from tests.train_helpers import REPO, micro_train_dict, train_script_main, write_yaml


def test_repo_yamls_load():
    for name in ("tiny.yaml", "tiny-m3.yaml"):
        tc = load_train_config(os.path.join(REPO, "configs", "train", name))
        cfg, _ = model_configs(tc)
        assert tc.data.seq_len <= cfg.max_position_embeddings
    tc = load_train_config(os.path.join(REPO, "configs", "train", "sparse_cpt.yaml"),
                           ["data.sources=[corpus]", "data.tokenizer=tok", "init.path=/no/such/ckpt"])
    assert tc.init.mode == "sparse_cpt" and tc.msa.freeze_backbone_in_warmup
    with pytest.raises(TrainConfigError, match="cannot build the model config.*/no/such/ckpt"):
        model_configs(tc)


def test_override_sets_value_and_type(tmp_path):
    p = write_yaml(micro_train_dict(str(tmp_path / "r")), str(tmp_path / "c.yaml"))
    tc = load_train_config(p, ["optim.lr=1e-3", "run.steps=17", "mesh=data=1,fsdp=1", "optim.freeze=[embed/.*]",
                               "model.hidden_size=48"])
    assert tc.optim.lr == pytest.approx(1e-3) and tc.run.steps == 17 and tc.mesh == "data=1,fsdp=1"
    assert tc.optim.freeze == ("embed/.*",)
    assert model_configs(tc)[0].hidden_size == 48


@pytest.mark.parametrize("item, words", [
    ("optim.learning_rate=1", ["learning_rate", "valid keys", "lr"]),
    ("optimizer.lr=1", ["optimizer", "valid sections"]),
    ("model.hidden=3", ["hidden", "hidden_size"]),
    ("data.shuffle_buffer=3", ["shuffle_buffer", "seq_len"]),
    ("run.steps", ["section.key=value"]),
])
def test_unknown_override_lists_valid_keys(tmp_path, item, words):
    raw = micro_train_dict(str(tmp_path / "r"))
    with pytest.raises(TrainConfigError) as e:
        from_dict(apply_overrides(raw, [item]))
    for w in words:
        assert w in str(e.value)


def test_unknown_yaml_key_rejected(tmp_path):
    raw = micro_train_dict(str(tmp_path / "r"), optim={"lr": 1e-3, "momentum": 0.9})
    with pytest.raises(TrainConfigError, match="momentum.*valid keys"):
        from_dict(raw)


@pytest.mark.parametrize("section, key, value, match", [
    ("optim", "lr", -1e-3, "optim.lr"),
    ("optim", "lr", 0.0, "optim.lr"),
    ("optim", "grad_accum", 3, "divisible by optim.grad_accum"),
    ("optim", "b2", 1.5, "optim.b2"),
    ("optim", "freeze", ["("], "not a valid regex"),
    ("optim", "mu_dtype", "float16", "optim.mu_dtype"),
    ("schedule", "kind", "linear", "schedule.kind"),
    ("msa", "warmup_schedule", "linear", "msa.warmup_schedule must be constant or cosine"),
    ("run", "remat", "some", "run.remat"),
    ("run", "compute_dtype", "int8", "run.compute_dtype"),
    ("checkpoint", "keep", 0, "checkpoint.keep"),
    ("init", "mode", "sparse_cpt", "needs init.path"),
    ("init", "path", "/some/ckpt", "init.mode is 'scratch'"),
])
def test_bad_values(tmp_path, section, key, value, match):
    raw = micro_train_dict(str(tmp_path / "r"), **{section: {key: value}})
    with pytest.raises(TrainConfigError, match=match):
        from_dict(raw)


def test_model_dependent_checks(tmp_path):
    tc = from_dict(micro_train_dict(str(tmp_path / "r"), data={"kind": "synthetic", "seq_len": 1024,
                                                                "batch_size": 4}))
    cfg, _ = model_configs(tc)
    with pytest.raises(TrainConfigError, match="max_position_embeddings"):
        validate_against(tc, cfg, 1)
    tc = from_dict(micro_train_dict(str(tmp_path / "r"), mesh="data=4,fsdp=2"))
    with pytest.raises(TrainConfigError, match="needs 8 devices but only 1"):
        validate_against(tc, model_configs(tc)[0], 1)
    tc = from_dict(micro_train_dict(str(tmp_path / "r"), mesh="data=8"))
    with pytest.raises(TrainConfigError, match="data-parallel size"):
        validate_against(tc, model_configs(tc)[0], 8)
    tc = from_dict(micro_train_dict(str(tmp_path / "r"), msa={"indexer_warmup_steps": 3}))
    with pytest.raises(TrainConfigError, match="no 'msa' layers"):
        validate_against(tc, model_configs(tc)[0], 1)


@pytest.mark.parametrize("field,name,backends", [("attention_impl", "cudnn_packed", "gpu"),
                                                 ("attention_impl", "pallas_flash_gpu", "gpu"),
                                                 ("attention_impl", "pallas_flash_tpu", "tpu"),
                                                 ("moe_impl", "pallas_gpu", "gpu"), ("msa_impl", "pallas_tpu", "tpu")])
def test_implementation_for_another_backend_is_refused(tmp_path, field, name, backends):
    tc = from_dict(micro_train_dict(str(tmp_path / "r"), model={field: name}))
    cfg, _ = model_configs(tc)
    with pytest.raises(TrainConfigError, match=f"model.{field}={name} runs only on {backends}, but .* 'cpu'"):
        validate_against(tc, cfg, 1, backend="cpu")
    assert not os.path.exists(tmp_path / "r")
    validate_against(tc, cfg, 1)                                  # no backend given: not checked
    ok = from_dict(micro_train_dict(str(tmp_path / "r"), model={field: "auto"}))
    validate_against(ok, model_configs(ok)[0], 1, backend="cpu")


@pytest.mark.parametrize("field", ["attention_impl", "sliding_attention_impl", "moe_impl", "msa_impl"])
def test_unknown_implementation_name_is_a_config_error(field):
    from minimax_jax.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=f"{field} must be one of .*'auto'.*got 'nonsense'"):
        load_config("tiny-m3").replace(**{field: "nonsense"})


def test_train_fails_before_compiling(tmp_path):
    """train() raises on a bad config without creating params, compiling, or writing a run dir."""
    from minimax_jax.train import train

    run_dir = tmp_path / "r"
    tc = from_dict(micro_train_dict(str(run_dir), data={"kind": "synthetic", "seq_len": 4096, "batch_size": 4}))
    t = time.perf_counter()
    with pytest.raises(TrainConfigError, match="max_position_embeddings"):
        train(tc)
    assert time.perf_counter() - t < 5 and not run_dir.exists()


def test_cli_reports_config_errors(tmp_path, capsys):
    """train.py's ``main`` in this process (the checks end before any compile; the script's exit status 2 from a
    subprocess: tests/train/test_train_check_only.py::test_missing_data_without_prepare_fails_clearly)."""
    main = train_script_main()
    p = write_yaml(micro_train_dict(str(tmp_path / "r")), str(tmp_path / "c.yaml"))
    capsys.readouterr()
    assert main(["--config", p, "--set", "optim.lr=-1"]) == 2
    assert "optim.lr must be a positive number" in capsys.readouterr().err
    assert main(["--config", p, "--set", "mesh=data=64"]) == 2
    assert "needs 64 devices" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_data_keys_are_named(tmp_path):
    raw = micro_train_dict(str(tmp_path / "r"))
    raw["data"] = {"kind": "grain", "sources": ["x"]}
    with pytest.raises(TrainConfigError, match=r"section 'data' \(kind=grain\) needs \['tokenizer', 'seq_len', "
                                               r"'batch_size'\]"):
        from_dict(raw)
