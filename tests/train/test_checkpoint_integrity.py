"""Train checkpoints carry a checksum per state leaf; a flipped byte (same file size) is caught on
restore naming the tensor, and the fallback to the previous step is ONE warning line (orbax's logs
silenced); a step saved without a manifest restores with one line; ``verify=False`` opts out."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.convert.errors import ChecksumMismatch
from minimax_jax.train.checkpointing import Checkpointer
from tests.checkpoint_helpers import blake2b_hex, flip_byte_of

TENSOR = "params.layers.3.mlp.w1"


def _state(step: int) -> dict:
    """Random bits as float32 (incompressible: orbax's zstd stores the bytes verbatim, so the test
    can find and flip them) plus an int step and an optimizer-like named leaf."""
    rng = np.random.default_rng(step)
    bits = lambda *s: jnp.asarray(rng.integers(0, 2 ** 32, s, dtype=np.uint32).view(np.float32))  # noqa: E731
    return {"params": {"layers": [{"mlp": {"w1": bits(32, 48)}} for _ in range(4)], "embed": bits(16, 8)},
            "opt": {"mu": bits(16, 8)}, "step": jnp.asarray(step, jnp.int32)}


def _target(_meta):
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), _state(0))


def _leaf(tree, name):
    for part in name.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


@pytest.fixture()
def run(tmp_path):
    d = str(tmp_path / "checkpoints")
    ck = Checkpointer(d, keep=3, async_save=True)
    for s in (2, 4):
        ck.save(s, _state(s), {"pos": s}, {"step": s})
    ck.close()
    return d


def _restore(d, capfd, **kw):
    capfd.readouterr()
    ck = Checkpointer(d, keep=3, async_save=False, **kw)
    try:
        got = ck.restore_latest(_target)
    finally:
        ck.close()
    return got, capfd.readouterr()


def test_manifest_digests_match_an_independent_hash(run):
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(run, item_names=("manifest",))
    m = mgr.restore(4, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))["manifest"]
    mgr.close()
    assert m["writer"] == "train" and m["hash"] == "blake2b-128"
    want = _state(4)
    assert set(m["tensors"]) == {TENSOR, "params.layers.0.mlp.w1", "params.layers.1.mlp.w1",
                                 "params.layers.2.mlp.w1", "params.embed", "opt.mu", "step"}
    for name, e in m["tensors"].items():
        assert e["digest"] == blake2b_hex(_leaf(want, name)), name


DAMAGES = ("flipped_byte", "truncated", "garbage")

#: Restores each run directory given on the command line in a fresh process (so nothing intercepts
#: orbax's absl logging or Python warnings, as in train.py); "--- NAME" on stderr before each.
CHILD = """
import json, sys
import numpy as np
from minimax_jax.train.checkpointing import Checkpointer
from tests.train.test_checkpoint_integrity import TENSOR, _leaf, _state, _target
for d in sys.argv[1:]:
    print("--- " + d, file=sys.stderr, flush=True)
    ck = Checkpointer(d, keep=3, async_save=False)
    step, state, data, meta = ck.restore_latest(_target)
    ck.close()
    same = all(np.asarray(_leaf(state, n)).tobytes() == np.asarray(_leaf(_state(step), n)).tobytes()
               for n in (TENSOR, "params.embed", "opt.mu", "step"))
    print(json.dumps({"step": step, "data": data, "meta": meta, "same": same}), flush=True)
"""


def _damage(run: str, damage: str) -> None:
    state_dir = os.path.join(run, "4", "state")
    if damage == "flipped_byte":
        flip_byte_of(state_dir, _leaf(_state(4), TENSOR))
        return
    for d, _, files in os.walk(state_dir):
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                data = f.read()
            with open(p, "wb") as f:
                f.write(data[:len(data) // 2] if damage == "truncated" else b"garbage")


def test_corrupt_newest_falls_back_in_one_warning_line(run, tmp_path):
    import json
    import subprocess
    import sys

    from tests.train_helpers import subprocess_env

    runs = []
    for damage in DAMAGES:
        d = str(tmp_path / damage / "checkpoints")
        shutil.copytree(run, d)
        _damage(d, damage)
        runs.append(d)
    r = subprocess.run([sys.executable, "-c", CHILD, *runs], capture_output=True, text=True, env=subprocess_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    blocks = r.stderr.split("--- ")[1:]
    assert [b.splitlines()[0] for b in blocks] == runs, r.stderr[-3000:]
    for damage, d, block, out in zip(DAMAGES, runs, blocks, r.stdout.splitlines()):
        assert json.loads(out) == {"step": 2, "data": {"pos": 2}, "meta": {"step": 2}, "same": True}
        lines = block.splitlines()[1:]
        assert len(lines) == 1, (damage, block[-3000:])                 # one line, orbax's logs silenced
        assert lines[0].startswith(f"warning: checkpoint step 4 in {d} cannot be restored ("), lines[0]
        assert lines[0].endswith(f"); falling back to step 2; moved 4 to {d}_corrupt"), lines[0]
        if damage == "flipped_byte":
            assert f"(tensor '{TENSOR}' checksum mismatch (file flipped or truncated))" in lines[0]
        assert sorted(os.listdir(d)) == ["2"] and len(os.listdir(d + "_corrupt")) == 1


def test_verification_opt_out_and_direct_restore(run, capfd):
    flip_byte_of(os.path.join(run, "4", "state"), _leaf(_state(4), TENSOR))
    ck = Checkpointer(run, keep=3, async_save=False)
    with pytest.raises(ChecksumMismatch) as e:
        ck.restore_state(4)
    ck.close()
    assert e.value.tensor == TENSOR
    assert str(e.value).startswith(f"checkpoint {run}/4: tensor '{TENSOR}' checksum mismatch "
                                   "(file flipped or truncated)")
    (step, state, _, _), out = _restore(run, capfd, verify=False)     # opted out: the damaged step loads
    assert step == 4 and out.err == ""
    assert np.asarray(_leaf(state, TENSOR)).tobytes() != np.asarray(_leaf(_state(4), TENSOR)).tobytes()


def test_step_without_manifest_restores_with_one_line(run, capfd):
    for s in ("2", "4"):
        shutil.rmtree(os.path.join(run, s, "manifest"))                 # as saved before manifests existed
    (step, state, _, _), out = _restore(run, capfd)
    assert step == 4
    np.testing.assert_array_equal(np.asarray(_leaf(state, TENSOR)), np.asarray(_leaf(_state(4), TENSOR)))
    assert out.err == (f"warning: checkpoint step 4 in {run} has no checksum manifest (saved by an older version), "
                       "restored without verification\n")


def test_restore_into_another_dtype_is_not_corruption(run, capfd):
    """A resume may cast (e.g. optimizer moments to a new mu_dtype): such leaves are not compared."""
    def target(meta):
        t = _target(meta)
        t["opt"]["mu"] = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=t["opt"]["mu"].sharding)
        return t

    capfd.readouterr()
    ck = Checkpointer(run, keep=3, async_save=False)
    step, state, _, _ = ck.restore_latest(target)
    ck.close()
    assert step == 4 and state["opt"]["mu"].dtype == jnp.bfloat16 and capfd.readouterr().err == ""
