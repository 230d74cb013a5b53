"""Usage errors that used to pass silently or end in a traceback: seeds outside [0, 2^32 - 1] (infer.py,
train.py), convert's export-only flags without --export, a --set value that is not YAML. Each is one line and
exit status 2."""


import pytest

from minimax_jax.convert import cli as convert_cli
from minimax_jax.infer import cli as infer_cli
from tests.train_helpers import micro_train_dict, train_script_main, write_yaml


def _status(main, argv):
    try:
        return main(argv)
    except SystemExit as e:         # argparse's usage errors
        return e.code


def _one_line(capsys, *needles):
    err = [x for x in capsys.readouterr().err.splitlines() if "compilation cache:" not in x]
    assert len(err) == 1 and "error: " in err[0] and all(n in err[0] for n in needles), err
    return err[0]



@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_infer_seed_out_of_range(seed, capsys):
    assert _status(infer_cli.main, ["--prompt", "x", "--seed", seed]) == 2
    _one_line(capsys, "--seed", "4294967295")


def test_infer_largest_seed_parses():
    assert infer_cli.parse(["--prompt", "x", "--seed", "4294967295"]).seed == 2 ** 32 - 1


def test_train_seeds_and_unparsable_set_values(tmp_path, capsys):
    cfg = write_yaml(micro_train_dict(str(tmp_path / "run")), str(tmp_path / "c.yaml"))
    main = train_script_main()
    for override, needle in (("run.seed=-1", "run.seed must be an integer in [0, 4294967295], got -1"),
                             ("run.seed=4294967296", "run.seed must be an integer in [0, 4294967295]"),
                             ("data.seed=-3", "data.seed must be an integer in [0, 4294967295], got -3"),
                             ("run.steps=[1", "override 'run.steps=[1': cannot parse '[1' as YAML")):
        assert main(["--config", cfg, "--set", override]) == 2, override
        _one_line(capsys, "configuration error: " + needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, named", [(["--fp8"], "--fp8 only applies with --export"),
                                          (["--max_shard_mb", "64"], "--max_shard_mb only applies with --export"),
                                          (["--no_verify"], "--no_verify only applies"),
                                          (["--fp8", "--max_shard_mb", "64"], "--fp8, --max_shard_mb only apply")])
def test_convert_export_flags_need_export(flags, named, tmp_path, capsys):
    assert _status(convert_cli.main, ["--src", str(tmp_path), "--dst", str(tmp_path / "out"), *flags]) == 2
    _one_line(capsys, named)
    assert not (tmp_path / "out").exists()
