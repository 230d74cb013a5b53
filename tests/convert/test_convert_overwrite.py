"""No data-loss paths in conversion: a destination that is, contains or lies inside the source is
refused (exit 2, one line naming both paths, nothing touched), even with --overwrite; --overwrite
replaces only a directory the converter wrote, atomically, and nothing beside it."""

import os

import pytest

from minimax_jax.convert.atomic_dir import check_destination
from minimax_jax.convert.cli import main
from minimax_jax.convert.errors import DestinationError, DestinationExistsError
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from tests import hf_fixtures as hf
from tests.checkpoint_helpers import snapshot
from tests.convert import test_convert_fixtures as fx


@pytest.fixture()
def tree(tmp_path):
    """``tmp_path/work/{hf (an HF checkpoint), ours (its conversion), notes.txt (unrelated)}``."""
    hf.require_hf()
    work = tmp_path / "work"
    work.mkdir()
    src = fx.saved_pretrained(hf.m2_model(3), str(work / "hf"))
    convert_hf_to_orbax(src, work / "ours", "float32", progress=False)
    (work / "notes.txt").write_text("unrelated")
    return work


def _refused(capsys, argv, *paths):
    assert main([*argv, "--no_progress", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m minimax_jax.convert: error: "), err
    assert "nothing was written" in err, err
    for p in paths:
        assert str(p) in err, (p, err)


@pytest.mark.parametrize("export", [False, True], ids=["convert", "export"])
def test_overwrite_never_deletes_the_source(tree, capsys, export):
    src = tree / ("ours" if export else "hf")
    before = snapshot(tree)
    extra = ["--export"] if export else []
    _refused(capsys, [*extra, "--src", str(src), "--dst", str(src)], src)               # dst == src
    _refused(capsys, [*extra, "--src", str(src), "--dst", str(tree)], src, tree)        # dst = parent of src
    _refused(capsys, [*extra, "--src", str(src), "--dst", str(src / "sub")], src)       # dst inside src
    _refused(capsys, [*extra, "--src", str(src), "--dst", str(tree / ".." / tree.name / src.name)], src)
    assert snapshot(tree) == before                                                    # nothing touched


def test_symlinked_destination_into_the_source_is_refused(tree):
    os.symlink(tree / "hf", tree / "link")
    with pytest.raises(DestinationError, match="is the source"):
        check_destination(tree / "link", sources=(tree / "hf",), overwrite=True)
    with pytest.raises(DestinationError, match="is inside the source"):
        convert_hf_to_orbax(tree / "hf", tree / "link" / "out", "float32", progress=False)
    assert not (tree / "hf" / "out").exists()


def test_overwrite_replaces_only_what_the_converter_wrote(tree, capsys):
    src = tree / "hf"
    with pytest.raises(DestinationExistsError, match="already exists"):
        convert_hf_to_orbax(src, tree / "ours", "float32", progress=False)
    # an earlier conversion holding a file a user put there is not replaced (the new output lacks it)
    (tree / "ours" / "my_notes.txt").write_text("the user's")
    before = snapshot(tree)
    assert main(["--src", str(src), "--dst", str(tree / "ours"), "--no_progress", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "my_notes.txt" in err and "nothing was replaced" in err, err
    assert snapshot(tree) == before and not [p for p in os.listdir(tree) if ".partial-" in p]
    # an earlier conversion (it holds our manifest) is replaced; its siblings are not touched
    (tree / "ours" / "my_notes.txt").unlink()
    siblings = {k: v for k, v in snapshot(tree).items() if not k.startswith("ours")}
    assert main(["--src", str(src), "--dst", str(tree / "ours"), "--no_progress", "--overwrite"]) == 0
    assert (tree / "ours" / "minimax_manifest.json").is_file()
    assert {k: v for k, v in snapshot(tree).items() if not k.startswith("ours")} == siblings
    assert not [p for p in os.listdir(tree) if ".partial-" in p]
    # a directory (or file) it did not write is never replaced, with or without --overwrite
    for victim in (tree / "mine", tree / "notes.txt"):
        if victim.name == "mine":
            victim.mkdir()
            (victim / "data.bin").write_bytes(b"keep me")
        before = snapshot(tree)
        assert main(["--src", str(src), "--dst", str(victim), "--no_progress", "--overwrite"]) == 2
        assert "was not written by minimax-jax" in capsys.readouterr().err
        assert snapshot(tree) == before
    # an export writes its manifest too, so a second export may replace the first
    assert main(["--export", "--src", str(tree / "ours"), "--dst", str(tree / "back"), "--no_progress"]) == 0
    assert main(["--export", "--src", str(tree / "ours"), "--dst", str(tree / "back"), "--no_progress",
                 "--overwrite"]) == 0
    assert (tree / "back" / "minimax_manifest.json").is_file()
