"""Sharding by logical axis names: meshes, the rule table, parameter/activation shardings.

Every parameter leaf carries logical axis names (``minimax_jax.model.param_axes``) and
activations are annotated with ``constrain(x, (...names...))``. ``configs/sharding.yaml`` maps the
names to the mesh axes ``data, fsdp, expert, sequence, tensor``; nothing in the model math names a
mesh axis. GSPMD (``jax.jit`` with ``NamedSharding``) partitions everything else, except the MoE
expert computation, which runs in ``shard_map`` (``minimax_jax.ops.moe.expert_parallel``) when a mesh is
active.

Typical use::

    mesh = make_mesh(MeshSpec.parse("fsdp=2,tensor=4"))
    rules = load_rules("default")
    shardings = minimax_jax.model.params_shardings(cfg, mesh, rules)
    params = jax.device_put(params, shardings)
    with use_mesh(mesh, rules):
        out = jax.jit(lambda p, t: forward(p, cfg, t))(params, jax.device_put(tokens, batch_sharding(mesh, rules)))
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MESH_AXES", "MeshSpec", "Rules", "ShardingError", "make_mesh", "load_rules", "preset_mesh_spec",
           "logical_to_spec", "tree_shardings", "use_mesh", "current", "constrain", "batch_sharding",
           "replicated"]

log = logging.getLogger(__name__)

#: Mesh axis names, outermost first (tensor innermost: it talks most, so it gets the nearest devices).
MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
_DEFAULT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                             "sharding.yaml")


class ShardingError(ValueError):
    """A mesh spec, rule table or sharding request is malformed or does not fit the devices."""


# ----------------------------------------------------------------------------- mesh
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the five mesh axes. ``-1`` on one axis means "all remaining devices"."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Parse ``"data=2,fsdp=2,tensor=2,expert=1"`` (unnamed axes are 1; spaces allowed).

        Raises ShardingError for unknown axes, repeated axes, non-integers, sizes < 1 other than
        a single -1.
        """
        sizes: dict[str, int] = {}
        for part in [p.strip() for p in text.split(",") if p.strip()]:
            if "=" not in part:
                raise ShardingError(f"mesh spec item {part!r} is not axis=size (in {text!r})")
            name, _, val = (s.strip() for s in part.partition("="))
            if name not in MESH_AXES:
                raise ShardingError(f"unknown mesh axis {name!r} in {text!r}; axes are {MESH_AXES}")
            if name in sizes:
                raise ShardingError(f"mesh axis {name!r} given twice in {text!r}")
            try:
                size = int(val)
            except ValueError:
                raise ShardingError(f"mesh axis {name!r} size {val!r} is not an integer") from None
            if size < 1 and size != -1:
                raise ShardingError(f"mesh axis {name!r} size must be >= 1 or -1, got {size}")
            sizes[name] = size
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ShardingError(f"at most one mesh axis may be -1, got {text!r}")
        return cls(**sizes)

    def sizes(self) -> tuple[int, ...]:
        """Axis sizes in ``MESH_AXES`` order (may contain one -1)."""
        return tuple(getattr(self, a) for a in MESH_AXES)

    def resolve(self, num_devices: int) -> "MeshSpec":
        """Replace a -1 by what remains of ``num_devices``; check the product.

        Raises ShardingError when the product differs from ``num_devices``.
        """
        sizes = dict(zip(MESH_AXES, self.sizes()))
        fixed = math.prod(v for v in sizes.values() if v != -1)
        free = [a for a, v in sizes.items() if v == -1]
        if free:
            if num_devices % fixed:
                raise ShardingError(f"mesh {self} fixes {fixed} devices, which does not divide {num_devices}")
            sizes[free[0]] = num_devices // fixed
        if math.prod(sizes.values()) != num_devices:
            raise ShardingError(
                f"mesh {self.__str__()} has {math.prod(sizes.values())} devices but {num_devices} are "
                f"available; the product of the axis sizes must equal the device count")
        return MeshSpec(**sizes)

    def __str__(self) -> str:
        return ",".join(f"{a}={v}" for a, v in zip(MESH_AXES, self.sizes()))


def make_mesh(spec: MeshSpec | str, devices: Sequence[Any] | None = None) -> Mesh:
    """Build a ``Mesh`` with axes ``MESH_AXES`` from the GLOBAL devices (all processes).

    Args:
      spec: a ``MeshSpec`` or its string form.
      devices: devices to use (default ``jax.devices()``, every process's devices).
    Returns: a Mesh whose axis types are Auto (GSPMD propagation; the model code is sharding-agnostic).
    Raises: ShardingError when the axis product differs from the number of devices.
    """
    if isinstance(spec, str):
        spec = MeshSpec.parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    spec = spec.resolve(len(devices))
    types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(spec.sizes(), MESH_AXES, axis_types=types, devices=devices)


# ----------------------------------------------------------------------------- rules
@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis name -> tuple of mesh axes (empty tuple = replicated). Immutable, hashable."""

    table: tuple[tuple[str, tuple[str, ...]], ...]
    name: str = "default"

    def __getitem__(self, logical: str) -> tuple[str, ...]:
        for k, v in self.table:
            if k == logical:
                return v
        raise ShardingError(f"logical axis {logical!r} has no rule in sharding table {self.name!r}; add it to "
                            f"configs/sharding.yaml")

    def as_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.table)


def _mesh_axes_of(logical: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    vals = [value] if isinstance(value, str) else list(value)
    for v in vals:
        if v not in MESH_AXES:
            raise ShardingError(f"rule {logical!r} -> {value!r}: {v!r} is not a mesh axis {MESH_AXES}")
    if len(set(vals)) != len(vals):
        raise ShardingError(f"rule {logical!r} -> {value!r} repeats a mesh axis")
    return tuple(vals)


def _rules_from(mapping: Mapping[str, Any], name: str) -> Rules:
    return Rules(tuple((str(k), _mesh_axes_of(k, v)) for k, v in mapping.items()), name)


def _read_table(path: str) -> dict[str, Any]:
    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), dict):
        raise ShardingError(f"{path}: expected a mapping with a 'rules' table")
    return doc


def load_rules(name_or_path: str = "default") -> Rules:
    """The rule table: ``"default"``, a preset name from configs/sharding.yaml, or a YAML file path.

    Raises ShardingError for an unknown preset, a malformed file or a rule naming a non-mesh axis.
    """
    if os.path.exists(name_or_path) and name_or_path.endswith((".yaml", ".yml")):
        doc = _read_table(name_or_path)
        return _rules_from(doc["rules"], name_or_path)
    doc = _read_table(_DEFAULT_FILE)
    if name_or_path == "default":
        return _rules_from(doc["rules"], "default")
    presets = doc.get("presets") or {}
    if name_or_path not in presets:
        raise ShardingError(f"unknown sharding preset {name_or_path!r}; known: default, {sorted(presets)} "
                            f"(or pass a path to a .yaml rule table)")
    over = presets[name_or_path].get("rules") or {}
    unknown = sorted(set(over) - set(doc["rules"]))
    if unknown:
        raise ShardingError(f"preset {name_or_path!r} overrides unknown logical axes {unknown}")
    return _rules_from({**doc["rules"], **over}, name_or_path)


def preset_mesh_spec(name: str) -> MeshSpec:
    """The recommended ``MeshSpec`` of a preset in configs/sharding.yaml (may hold a -1)."""
    presets = _read_table(_DEFAULT_FILE).get("presets") or {}
    if name not in presets or "mesh" not in presets[name]:
        raise ShardingError(f"sharding preset {name!r} has no mesh; known presets: {sorted(presets)}")
    return MeshSpec.parse(presets[name]["mesh"])


# ----------------------------------------------------------------------------- specs
def logical_to_spec(axes: Sequence[str | None], rules: Rules, *, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, strict: bool = False) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have the logical names ``axes``.

    A mesh axis already used by an earlier dimension is dropped from later ones. With ``shape`` and
    ``mesh`` given, mesh axes (from the minor end) that do not divide a dimension are dropped too:
    logged as a warning, or ShardingError when ``strict``. ``None`` in ``axes`` means replicated.
    Raises ShardingError for a logical name without a rule.
    """
    return _spec(axes, rules, shape, mesh, "error" if strict else "warn")


def _spec(axes, rules, shape, mesh, on_indivisible: str) -> PartitionSpec:
    used: set[str] = set()
    out = []
    for d, name in enumerate(axes):
        mesh_axes = [] if name is None else [a for a in rules[name] if a not in used]
        if shape is not None and mesh is not None:
            while mesh_axes and shape[d] % math.prod(mesh.shape[a] for a in mesh_axes):
                msg = (f"dimension {d} ({name!r}, size {shape[d]}) is not divisible by mesh axes {mesh_axes} "
                       f"(sizes {[mesh.shape[a] for a in mesh_axes]})")
                if on_indivisible == "error":
                    raise ShardingError(msg)
                if on_indivisible == "warn":
                    log.warning("%s: not sharding it over %r", msg, mesh_axes[-1])
                mesh_axes = mesh_axes[:-1]
        used.update(mesh_axes)
        out.append(None if not mesh_axes else (mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)))
    return PartitionSpec(*out)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def tree_shardings(axes: Any, shapes: Any, mesh: Mesh, rules: Rules, *, strict: bool = False) -> Any:
    """Pytree of ``NamedSharding``: one per leaf of ``axes`` (tuples of logical axis names), sized by the
    matching leaf of ``shapes`` (arrays or ShapeDtypeStructs, same structure). The model's parameter
    shardings are ``minimax_jax.model.params_shardings(cfg, mesh, rules)``.

    Dimensions not divisible by their mesh axes are replicated over those axes (warning), or raise
    ShardingError when ``strict``.
    """
    return jax.tree.map(
        lambda a, s: NamedSharding(mesh, logical_to_spec(a, rules, shape=s.shape, mesh=mesh, strict=strict)),
        axes, shapes, is_leaf=_is_axes)


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of ``[B, T]`` model inputs (tokens, positions, segment ids, targets)."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules))


# ----------------------------------------------------------------------------- context
_state = threading.local()


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Make ``(mesh, rules)`` current: ``constrain`` annotates and the MoE op runs expert-parallel.

    Must surround the *tracing* of the jitted function (the first call, or ``.lower``).
    Nestable; restores the previous context on exit. The mesh is also made jax's context mesh
    (``jax.set_mesh``), which is part of jit's cache key: a function jitted once and called under
    another mesh (or outside any) is traced again instead of reusing a trace made for a different
    mesh. The rules are not in that key: switching rule tables over the same mesh needs a fresh
    ``jax.jit`` object (or ``jax.clear_caches()``).
    """
    prev = getattr(_state, "ctx", None)
    _state.ctx = (mesh, rules)
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _state.ctx = prev


def current() -> tuple[Mesh, Rules] | None:
    """The active ``(mesh, rules)`` or None outside ``use_mesh``."""
    return getattr(_state, "ctx", None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names inside ``use_mesh``; the identity outside.

    Mesh axes that do not divide a dimension are left out for that dimension (no warning: activation
    shapes vary). Raises ShardingError when ``len(logical_axes) != x.ndim``.
    """
    ctx = current()
    if ctx is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ShardingError(f"constrain: {len(logical_axes)} names {tuple(logical_axes)} for a {x.ndim}-d array")
    mesh, rules = ctx
    spec = _spec(logical_axes, rules, x.shape, mesh, "drop")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def mesh_axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """Product of the sizes of ``axes`` on ``mesh`` (1 for none)."""
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
