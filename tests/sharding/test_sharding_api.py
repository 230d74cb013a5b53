"""Sharding API on one CPU device: mesh specs, the rule table, logical -> PartitionSpec, params
shardings, constrain outside/inside use_mesh, and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from minimax_jax import sharding as sh

from minimax_jax.model import params_shardings
from minimax_jax.config import ModelConfig
from minimax_jax.model.params import abstract_params, param_axes


def test_mesh_spec_parse_and_resolve():
    s = sh.MeshSpec.parse("data=2, fsdp=2,tensor=2,expert=1")
    assert s == sh.MeshSpec(data=2, fsdp=2, expert=1, sequence=1, tensor=2)
    assert s.sizes() == (2, 2, 1, 1, 2)
    assert str(s) == "data=2,fsdp=2,expert=1,sequence=1,tensor=2"
    assert sh.MeshSpec.parse("fsdp=-1,tensor=2").resolve(8) == sh.MeshSpec(fsdp=4, tensor=2)
    assert sh.MeshSpec.parse("").resolve(1) == sh.MeshSpec()
    for bad, msg in [("model=2", "unknown mesh axis"), ("data=2,data=2", "twice"), ("data=x", "not an integer"),
                     ("data=0", ">= 1"), ("data=-1,fsdp=-1", "at most one"), ("data", "axis=size")]:
        with pytest.raises(sh.ShardingError, match=msg):
            sh.MeshSpec.parse(bad)
    with pytest.raises(sh.ShardingError, match="device count"):
        sh.MeshSpec.parse("data=2,tensor=2").resolve(8)
    with pytest.raises(sh.ShardingError, match="does not divide"):
        sh.MeshSpec.parse("data=3,fsdp=-1").resolve(8)


def test_make_mesh_on_this_process():
    mesh = sh.make_mesh("data=1")
    assert mesh.axis_names == sh.MESH_AXES
    assert dict(mesh.shape) == {a: 1 for a in sh.MESH_AXES}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(sh.ShardingError, match="device count"):
        sh.make_mesh("data=2")


def test_rules_default_and_presets():
    r = sh.load_rules()
    assert r["batch"] == ("data", "fsdp", "expert")
    assert r["experts"] == ("expert",) and r["mlp_expert"] == ("tensor",) and r["norm"] == ()
    dp = sh.load_rules("dp")
    assert dp["embed"] == () and dp["experts"] == () and dp["batch"] == r["batch"]
    assert sh.preset_mesh_spec("fsdp_tp") == sh.MeshSpec(fsdp=-1, tensor=8)
    with pytest.raises(sh.ShardingError, match="unknown sharding preset"):
        sh.load_rules("nope")
    with pytest.raises(sh.ShardingError, match="no rule"):
        r["not_an_axis"]


def test_every_param_axis_has_a_rule_and_all_presets_load():
    rules = [sh.load_rules(n) for n in ("default", "dp", "fsdp", "fsdp_tp", "ep", "ep_tp", "long_context")]
    for path in ("configs/tiny-m2.yaml", "configs/tiny-m3.yaml", "configs/minimax-m2.yaml", "configs/minimax-m3.yaml"):
        cfg = ModelConfig.from_yaml(path)
        names = {a for leaf in jax.tree.leaves(param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple)) for a in leaf}
        for r in rules:
            for n in names:
                r[n]  # raises when missing


def test_rule_file_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("rules:\n  batch: [data, model]\n")
    with pytest.raises(sh.ShardingError, match="not a mesh axis"):
        sh.load_rules(str(p))
    p.write_text("rules:\n  batch: [data, data]\n")
    with pytest.raises(sh.ShardingError, match="repeats"):
        sh.load_rules(str(p))
    p.write_text("rules:\n  batch: data\n  embed: null\n")
    r = sh.load_rules(str(p))
    assert r["batch"] == ("data",) and r["embed"] == ()


def test_logical_to_spec_dedup_and_divisibility():
    r = sh.load_rules()
    assert sh.logical_to_spec(("layers", "experts", "embed_expert", "mlp_expert"), r) == P(None, "expert", "fsdp", "tensor")
    assert sh.logical_to_spec(("batch", "length", "act_embed"), r) == P(("data", "fsdp", "expert"), "sequence", None)
    # A mesh axis is used once per array: the second "embed" drops fsdp.
    assert sh.logical_to_spec(("embed", "embed"), r) == P("fsdp", None)
    assert sh.logical_to_spec((None, "vocab"), r) == P(None, "tensor")


def test_params_shardings_structure_and_specs():
    cfg = ModelConfig.from_yaml("configs/tiny-m3.yaml")
    mesh = sh.make_mesh("data=1")
    shard = params_shardings(cfg, mesh, sh.load_rules())
    assert jax.tree.structure(shard) == jax.tree.structure(abstract_params(cfg))
    mlp = shard["segments"][1]["mlp"]
    assert mlp["wi"].spec == P(None, "expert", "fsdp", "tensor")
    assert mlp["router"].spec == P(None, "fsdp", None)
    assert shard["lm_head"].spec == P("fsdp", "tensor")
    assert shard["embed"]["embedding"].spec == P("tensor", "fsdp")


def test_constrain_is_identity_outside_and_checks_rank_inside():
    x = jnp.arange(12.0).reshape(3, 4)
    assert sh.constrain(x, ("batch", "act_embed")) is x
    assert sh.current() is None
    mesh = sh.make_mesh("data=1")
    with sh.use_mesh(mesh, sh.load_rules()):
        assert sh.current()[0] is mesh
        y = jax.jit(lambda a: sh.constrain(a, ("batch", "act_embed")) * 2)(x)
        with pytest.raises(sh.ShardingError, match="3 names"):
            sh.constrain(x, ("batch", "length", "act_embed"))
    assert sh.current() is None
    assert (y == 2 * x).all()
    assert sh.batch_sharding(mesh, sh.load_rules()).spec == P(("data", "fsdp", "expert"), "sequence")


def test_use_mesh_is_part_of_the_jit_cache_key():
    """A function jitted once is traced again when called under a mesh, so ``constrain`` and the
    expert-parallel MoE see the mesh current at the call, not a stale trace from outside it (two
    different meshes over 2 devices retrace too: checked by hand, needs a multi-device process)."""
    traces = []

    @jax.jit
    def f(a):
        traces.append(sh.current())
        return sh.constrain(a * 2, ("batch", "act_embed"))

    x = jnp.ones((2, 4))
    f(x)
    f(x)
    assert traces == [None]                      # cached outside any mesh
    mesh_a, rules = sh.make_mesh("data=1"), sh.load_rules()
    with sh.use_mesh(mesh_a, rules):
        f(x)
        f(x)
    assert len(traces) == 2 and traces[1][0] is mesh_a
    f(x)
    assert len(traces) == 2                      # back outside: the first trace again
