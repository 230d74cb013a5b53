"""``load_checkpoint`` restores straight onto a device mesh: each leaf arrives with its
``NamedSharding`` and the same values as a plain single-device load (4 CPU devices, subprocess)."""

import os
import subprocess
import sys
import textwrap

from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx

_CHILD = textwrap.dedent(r"""
    import sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from minimax_jax.convert.load import load_checkpoint
    from minimax_jax.model import params_shardings
    from minimax_jax.sharding import load_rules, make_mesh
    assert len(jax.devices()) == 4, jax.devices()
    d = sys.argv[1]
    cfg, plain = load_checkpoint(d)
    mesh = make_mesh("fsdp=2,tensor=2")
    cfg2, sharded = load_checkpoint(d, mesh=mesh)
    want = params_shardings(cfg, mesh, load_rules("default"))
    n_split = 0
    for (path, a), b, w in zip(jax.tree_util.tree_flatten_with_path(plain)[0], jax.tree.leaves(sharded),
                               jax.tree.leaves(want)):
        assert b.sharding == w, (jax.tree_util.keystr(path), b.sharding, w)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
        n_split += len(b.addressable_shards) > 1 and b.addressable_shards[0].data.size < b.size
    assert n_split >= 5, n_split
    # explicit shardings pytree (no sharding module needed): everything replicated
    rep = jax.tree.map(lambda _: NamedSharding(mesh, P()), want)
    _, r = load_checkpoint(d, shardings=rep)
    assert all(x.sharding == NamedSharding(mesh, P()) for x in jax.tree.leaves(r))
    print("OK", n_split)
""")


def test_load_onto_mesh(tmp_path):
    hf.require_hf()
    from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax

    model = hf.m3_model(51, hidden=32, heads=4, kv=2)
    src = fx.saved_pretrained(model, str(tmp_path / "hf"))
    convert_hf_to_orbax(src, tmp_path / "ours", "float32", progress=False)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd(),
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ours")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


def test_relative_checkpoint_path(tmp_path, monkeypatch):
    """orbax finds no item metadata under a relative path; load_checkpoint must not care."""
    import jax
    import numpy as np

    from minimax_jax.config import load_config
    from minimax_jax.convert import load_checkpoint
    from minimax_jax.convert.save import save_checkpoint
    from minimax_jax.model import init_params

    cfg = load_config("tiny-m2")
    params = init_params(cfg, jax.random.key(0))
    save_checkpoint(params, cfg, tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    got_cfg, got = load_checkpoint("ck")
    assert got_cfg == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
