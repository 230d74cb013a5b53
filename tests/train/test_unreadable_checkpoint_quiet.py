"""An unreadable checkpoint (truncated weight files) ends in ONE error line or ONE fallback warning:
no "Event loop is closed" / never-awaited-coroutine tracebacks from orbax's abandoned reads, and the
export CLI names a bad --run_dir instead of an errno message."""

import glob
import os
import subprocess
import sys

import pytest

from tests.train.test_train_export import _export_cli, _fake_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _truncate_weights(directory) -> None:
    files = glob.glob(os.path.join(str(directory), "**", "ocdbt.process_0", "d", "*"), recursive=True)
    assert files, directory
    for f in files:
        os.truncate(f, 10)


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def test_unreadable_run_checkpoint_export_is_one_line_and_quiet(tmp_path):
    run, _ = _fake_run(tmp_path)
    _truncate_weights(run / "checkpoints" / "3" / "state")
    p = _run("import sys, gc, time\n"
             "from minimax_jax.train.export import main\n"
             f"code = main(['--run_dir', {str(run)!r}, '--dst', {str(tmp_path / 'ck')!r}, '--dtype', 'float32'])\n"
             "gc.collect(); time.sleep(1); gc.collect()\n"
             "sys.exit(code)\n")
    assert p.returncode == 1, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr[:3000]
    assert lines[0].startswith(f"python -m minimax_jax.train.export: error: checkpoint {run}/checkpoints/3: "
                               "reading it failed, the files are truncated or corrupt ("), lines[0]
    assert "TensorStore(" not in lines[0] and len(lines[0]) < 800
    assert not (tmp_path / "ck").exists()


def test_unreadable_inference_checkpoint_load_is_quiet(tmp_path):
    from minimax_jax.convert.save import save_checkpoint
    from tests import infer_helpers as H
    from tests.train_helpers import random_params

    cfg = H.tiny_config(64)
    d = tmp_path / "ckpt"
    save_checkpoint(random_params(cfg), cfg, str(d), dtype="float32")
    _truncate_weights(d / "params")
    p = _run("import gc, time\n"
             "from minimax_jax.convert import load_checkpoint\n"
             "from minimax_jax.convert.errors import CorruptFileError\n"
             "try:\n"
             f"    load_checkpoint({str(d)!r})\n"
             "except CorruptFileError as e:\n"
             "    print('refused:', str(e)[:60])\n"
             "gc.collect(); time.sleep(1); gc.collect()\n")
    assert p.returncode == 0 and p.stdout.startswith("refused: checkpoint"), (p.stdout, p.stderr[:3000])
    assert p.stderr == "", p.stderr[:3000]


def test_the_filter_drops_only_the_teardown_noise(monkeypatch):
    import types

    from minimax_jax.convert import errors

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(errors, "_QUIET_INSTALLED", False)
    import warnings
    with warnings.catch_warnings():             # the filter it adds stays inside this block
        errors.quiet_failed_read_teardown()
        errors.quiet_failed_read_teardown()     # once per process
        def call_soon_threadsafe():
            raise RuntimeError("Event loop is closed")

        def elsewhere():
            raise RuntimeError("Event loop is closed")

        def raised(f):
            try:
                f()
            except RuntimeError as e:
                return e
        noise, own = raised(call_soon_threadsafe), raised(elsewhere)
        other = RuntimeError("something else")
        for exc in (noise, other, ValueError("Event loop is closed"), own):
            sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc, object=None,
                                                     exc_traceback=exc.__traceback__ and exc.__traceback__.tb_next))
    assert seen[0] is other and isinstance(seen[1], ValueError) and seen[2] is own and len(seen) == 3
    import logging

    def record(future):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved\nfuture: %s",
                                 (future,), None)
    assert not errors._drop_abandoned_orbax_tasks(record("<Task coro=<async_deserialize() at /v/orbax/s.py:1>>"))
    assert errors._drop_abandoned_orbax_tasks(record("<Task coro=<mine() at /v/app.py:1>>"))
    assert not errors._drop_abandoned_orbax_tasks(record(
        "<Future finished exception=ValueError('OUT_OF_RANGE: Error reading \"x/0.0\" in OCDBT database at ...')>"))
    logging.getLogger("asyncio").removeFilter(errors._drop_abandoned_orbax_tasks)


@pytest.mark.parametrize("what", ["missing", "file", "not_a_run"])
def test_export_names_a_bad_run_dir(tmp_path, capsys, what):
    run = tmp_path / "run"
    if what == "file":
        run.write_text("x")
    elif what == "not_a_run":
        run.mkdir()
    code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(tmp_path / "ck"))
    want = {"missing": f"run directory {str(run)!r} does not exist",
            "file": f"run directory {str(run)!r} is a file; pass the directory train.py wrote",
            "not_a_run": f"{str(run)!r} is not a train.py run directory (it has no model_config.yaml"}[what]
    assert code == 2 and err.count("\n") == 1 and want in err, err
    assert "Errno" not in err and not (tmp_path / "ck").exists()
