"""minimax_jax.ops.registry: one table of implementations per op, one dispatch, the report of what ran."""

import os
import re

import pytest

import minimax_jax.ops  # noqa: F401  (registers every op)
from minimax_jax.config import (IMPLEMENTATION_FIELDS, RENAMED, ConfigError, ModelConfig,
                                implementation_backends)
from minimax_jax.ops import registry
from minimax_jax.ops.registry import Implementation, ImplementationUnavailable
from tests.paths import REPO_ROOT


@pytest.fixture
def toy_op():
    """A throw-away op: a GPU kernel that serves only even inputs, an interpreter, the reference."""
    name = "toy_op_for_registry_tests"
    registry._ops.pop(name, None)
    registry.register(name, [
        Implementation("xla", lambda x: ("xla", x)),
        Implementation("pallas_gpu", lambda x: ("gpu", x), platforms=("gpu",),
                       supports=lambda x: None if x % 2 == 0 else f"odd input {x}"),
        Implementation("pallas_gpu_interpret", lambda x: ("interp", x),
                       supports=lambda x: None if x % 2 == 0 else f"odd input {x}"),
    ], auto=lambda backend, x: ["pallas_gpu", "xla"] if backend == "gpu" else ["xla"])
    registry.clear_implementation_report()
    yield name
    registry._ops.pop(name, None)


def test_explicit_names_run_or_say_why_not(toy_op):
    assert registry.dispatch(toy_op, "xla", 3) == ("xla", 3)
    assert registry.dispatch(toy_op, "pallas_gpu_interpret", 4) == ("interp", 4)
    assert registry.implementation_report()[toy_op] == "xla; pallas_gpu_interpret"     # both, first-seen order
    with pytest.raises(ImplementationUnavailable, match="cannot serve this call: odd input 5"):
        registry.dispatch(toy_op, "pallas_gpu_interpret", 5)
    with registry.assume_backend("cpu"), pytest.raises(ImplementationUnavailable,
                                                       match="needs a GPU backend, not 'cpu'"):
        registry.dispatch(toy_op, "pallas_gpu", 4)
    with pytest.raises(ImplementationUnavailable, match="unknown implementation 'cuda'; expected one of "
                                                      "auto|xla|pallas_gpu|pallas_gpu_interpret"):
        registry.dispatch(toy_op, "cuda", 4)


def test_auto_takes_the_first_that_serves_and_records_why_others_were_passed_over(toy_op):
    with registry.assume_backend("cpu"):
        assert registry.dispatch(toy_op, "auto", 4) == ("xla", 4)      # CPU: the reference only
    assert registry.implementation_report() == {toy_op: "xla"}
    with registry.assume_backend("gpu"):
        assert registry.resolve(toy_op, "auto", 4).name == "pallas_gpu"
        assert registry.implementation_report() == {toy_op: "xla"}     # resolve records nothing
        registry.clear_implementation_report()
        assert registry.dispatch(toy_op, "auto", 4) == ("gpu", 4)
        assert registry.implementation_report()[toy_op] == "pallas_gpu"
        assert registry.dispatch(toy_op, "auto", 5) == ("xla", 5)
        assert registry.dispatch(toy_op, "auto", 7) == ("xla", 7)
        report = registry.implementation_report()
        # both choices since the last clear, in the order first made; a reason only once per distinct text
        assert report[toy_op] == "pallas_gpu; xla", report
        assert report[f"{toy_op}.auto_reason"] == "pallas_gpu: odd input 5; pallas_gpu: odd input 7", report
        assert registry.dispatch(toy_op, "auto", 5) == ("xla", 5) and registry.implementation_report() == report


def test_an_implementation_refines_what_its_dispatch_recorded(toy_op):
    """``refine_implementation`` inside an implementation replaces the plain name its own dispatch added (the
    expert-parallel MoE reports ``expert_parallel[...]``, not ``xla_ragged`` too); a name an earlier call had
    recorded stays."""
    registry._ops.pop(toy_op)
    registry.register(toy_op, [
        Implementation("xla", lambda x: ("xla", x)),
        Implementation("xla_split", lambda x: registry.refine_implementation(toy_op, f"xla_split[{x}]") or x)],
        auto=lambda backend, x: ["xla"])
    registry.clear_implementation_report()
    registry.dispatch(toy_op, "xla_split", 2)
    assert registry.implementation_report() == {toy_op: "xla_split[2]"}
    registry.dispatch(toy_op, "xla", 1)
    registry.dispatch(toy_op, "xla_split", 3)
    assert registry.implementation_report() == {toy_op: "xla_split[2]; xla; xla_split[3]"}
    registry.record_implementation(toy_op, "xla_split")      # the plain name recorded by another call ...
    registry.dispatch(toy_op, "xla_split", 4)                 # ... is kept when a later call refines its own
    assert registry.implementation_report()[toy_op].split("; ")[-2:] == ["xla_split", "xla_split[4]"]


def test_registration_errors(toy_op):
    with pytest.raises(ValueError, match="registered already"):
        registry.register(toy_op, [Implementation("xla", abs)], auto=lambda b, *a: ["xla"])
    xla_only = lambda b, *a: ["xla"]  # noqa: E731
    with pytest.raises(ValueError, match="registered twice or reserved"):
        registry.register("another_toy", [Implementation("xla", abs), Implementation("xla", abs)], auto=xla_only)
    with pytest.raises(ValueError, match="registered twice or reserved"):
        registry.register("another_toy", [Implementation("auto", abs)], auto=xla_only)
    with pytest.raises(TypeError, match="another_toy: auto must be callable"):
        registry.register("another_toy", [Implementation("xla", abs)], auto=None)
    assert "another_toy" not in registry._ops
    with pytest.raises(KeyError, match="no op 'nope' registered"):
        registry.get_op("nope")


def test_an_auto_policy_naming_an_unregistered_implementation_is_a_clear_error():
    name = "toy_op_with_a_bad_auto"
    registry._ops.pop(name, None)
    registry.register(name, [Implementation("xla", abs)], auto=lambda backend, x: ["pallas_gpu", "xla"])
    try:
        for call in (registry.resolve, registry.dispatch):
            with pytest.raises(ValueError, match=f"^{name}: its auto policy named 'pallas_gpu', which is not "
                                                 "registered; registered: xla$"):
                call(name, "auto", -3)
        assert registry.dispatch(name, "xla", -3) == 3          # explicit names are unaffected
    finally:
        registry._ops.pop(name, None)


def test_every_op_is_registered_with_one_naming_scheme():
    ops = {"attention", "msa_index_scores", "msa_select_blocks", "msa_attention", "indexer_kl", "moe",
           "grouped_matmul", "paged_attention", "msa_decode_select", "prefill_attention"}
    assert ops <= set(registry._ops)
    scheme = r"^(xla(_[a-z]+)?|tokamax|cudnn(_packed)?|[a-z]+(_[a-z]+)?_(gpu|tpu)(_interpret)?)$"
    for name in ops:
        op = registry.get_op(name)
        assert op.names[0] == "auto" and any(n.startswith("xla") for n in op.names), (name, op.names)
        for impl in op.implementations.values():
            assert re.match(scheme, impl.name), (name, impl.name)
            if impl.name.endswith("_interpret") or impl.name.startswith("xla"):
                assert impl.platforms is None, (name, impl.name)      # interpreters and XLA run anywhere


def test_config_takes_the_registered_names_and_refuses_old_ones():
    cfg = ModelConfig.from_yaml(os.path.join(REPO_ROOT, "configs", "tiny-m3.yaml"))
    for field, op in IMPLEMENTATION_FIELDS.items():
        for name in registry.implementation_names(op):
            assert getattr(cfg.replace(**{field: name}), field) == name
    assert implementation_backends(cfg.replace(attention_impl="pallas_flash_tpu", moe_impl="pallas_gpu")) == {
        "model.attention_impl=pallas_flash_tpu": ("tpu",), "model.moe_impl=pallas_gpu": ("gpu",)}
    for field, old, new in (("attention_impl", "pallas_flash", "pallas_flash_gpu or pallas_flash_tpu"),
                            ("moe_impl", "dense", "xla_dense"), ("moe_impl", "ragged", "xla_ragged"),
                            ("moe_impl", "capacity", "xla_capacity"), ("msa_impl", "pallas_interpret",
                                                                       "pallas_tpu_interpret")):
        with pytest.raises(ConfigError, match=re.escape(f"{field} must be one of "
                                                        f"{registry.implementation_names(IMPLEMENTATION_FIELDS[field])}"
                                                        f", got {old!r} ({old!r} was renamed to {new})")):
            cfg.replace(**{field: old})
    with pytest.raises(ConfigError) as e:
        cfg.replace(moe_impl="megablox")
    assert str(e.value) == f"moe_impl must be one of {registry.implementation_names('moe')}, got 'megablox'"
    for op, renamed in RENAMED.items():              # every hint names registered implementations
        for new in renamed.values():
            assert set(new.split(" or ")) <= set(registry.implementation_names(op)), (op, new)
