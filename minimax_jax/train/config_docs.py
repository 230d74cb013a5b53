"""Generate ``docs/CONFIG.md``: every config key with its type, default and meaning, from the code.

    python -m minimax_jax.train.config_docs > docs/CONFIG.md

Meanings are the ``Attributes:`` entries of the config dataclasses' docstrings (``ModelConfig``,
the training sections, ``DataConfig``); a field without one raises ``ValueError`` naming it.
Defaults and types are the dataclass fields'; the ``*_impl`` choices come from the op registry;
the sharding table is ``configs/sharding.yaml`` itself (its inline comments are the meanings).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from typing import Any

import yaml

import minimax_jax.ops  # noqa: F401  (registers every op's implementations)
from minimax_jax import sharding
from minimax_jax.config import IMPLEMENTATION_FIELDS, ModelConfig
from minimax_jax.ops.registry import implementation_names
from minimax_jax.data.pipeline import DataConfig
from minimax_jax.data.trajectories import TrajectoryConfig
from minimax_jax.train import config as tcfg
from minimax_jax.train.data import SyntheticIterator

__all__ = ["doc_entries", "render"]

REGENERATE = "python -m minimax_jax.train.config_docs > docs/CONFIG.md"
SHARDING_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "configs", "sharding.yaml")
_ENTRY = re.compile(r"^([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*):\s+(.*)$")


def doc_entries(doc: str | None, heading: str = "Attributes") -> dict[str, str]:
    """``{name: text}`` of a Google-style ``heading:`` block of ``doc`` (``a, b: text`` gives both names
    the text; continuation lines are joined). Empty when the block is missing."""
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = lines.index(f"{heading}:") + 1
    except ValueError:
        return {}
    out: dict[str, str] = {}
    indent, names = None, []
    for line in lines[start:]:
        if not line.strip():
            continue
        ind = len(line) - len(line.lstrip())
        if indent is None:
            indent = ind
        if ind < indent or ind == 0:
            break
        m = _ENTRY.match(line.strip()) if ind == indent else None
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
        elif names:
            for n in names:
                out[n] += " " + line.strip()
    return out


def _described(cls, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Field -> meaning for the dataclass ``cls``; ValueError naming undocumented / unknown entries."""
    docs = doc_entries(cls.__doc__)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    missing = [n for n in names if n not in docs]
    if missing:
        raise ValueError(f"{cls.__module__}.{cls.__qualname__}: field(s) {missing} have no entry in the "
                         f"docstring's Attributes: section; add one, then run `{REGENERATE}`")
    stale = sorted(set(docs) - {f.name for f in dataclasses.fields(cls)})
    if stale:
        raise ValueError(f"{cls.__qualname__}: the Attributes: section names {stale}, which are not fields")
    return {n: docs[n] for n in names}


# ----------------------------------------------------------------------------- formatting
def _value(v: Any) -> str:
    """A default as it would be written in YAML."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v) if v != "" else '""'


def _type(t: Any) -> str:
    t = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    t = re.sub(r"tuple\[(\w+), \.\.\.\]", r"list[\1]", t)
    return t.replace("None", "null").replace("dict", "mapping").replace("Any", "any")


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _value(f.default_factory())
    return "required"


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {_cell(t)} | {f'`{d}`' if d else ''} | {_cell(m)} |" for k, t, d, m in rows]
    return out + [""]


def _summary(cls) -> str:
    return _cell(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " "))


def _dataclass_rows(cls, prefix: str = "", skip: tuple[str, ...] = (), extra: dict | None = None) -> list:
    docs = _described(cls, skip)
    extra = extra or {}
    return [(prefix + f.name, _type(f.type), _default(f), docs[f.name] + extra.get(f.name, ""))
            for f in dataclasses.fields(cls) if f.name not in skip]


def _impl_choices() -> dict[str, str]:
    return {field: " Choices: " + ", ".join(f"``{n}``" for n in implementation_names(op)) + "."
            for field, op in IMPLEMENTATION_FIELDS.items()}


# ----------------------------------------------------------------------------- sections
def _model() -> list[str]:
    return ["## Model config", "",
            "`configs/<name>.yaml` (these keys, optionally under `model:`), read by `load_config(name_or_path)`; "
            "the `model` section of a training YAML overrides them. Fields of `minimax_jax.config.ModelConfig`.", "",
            *_table(_dataclass_rows(ModelConfig, extra=_impl_choices()))]


def _train_intro() -> list[str]:
    docs = _described(tcfg.TrainConfig)
    out = ["## Training config", "",
           "`configs/train/*.yaml`, read by `train.py --config FILE`; any key can be changed with "
           "`--set section.key=value` (values parsed as YAML). Unknown sections and keys are refused. "
           "Sections (`minimax_jax.train.config.TrainConfig`):", "",
           "| section | meaning |", "|---|---|"]
    out += [f"| `{n}` | {_summary(tcfg.SECTIONS[n]) if n in tcfg.SECTIONS else _cell(docs[n])} |"
            for n in tcfg.TOP_LEVEL]
    return out + [""]


def _model_section() -> list[str]:
    name = ("model.name", "str | null", "null", _described(tcfg.TrainConfig)["model"])
    field = ("model.<field>", "", "", "any Model config key above, overriding the named config's value.")
    return ["### `model`", "", *_table([name, field])]


def _data_section() -> list[str]:
    ds = _described(tcfg.DataSection, skip=("fields",))
    kind = {f.name: f for f in dataclasses.fields(tcfg.DataSection)}["kind"]
    synth = doc_entries(tcfg.DataSection.__doc__, "Synthetic keys")
    params = inspect.signature(SyntheticIterator.__init__).parameters
    missing = [k for k in tcfg.DataSection.SYNTHETIC_KEYS if k not in synth]
    if missing:
        raise ValueError(f"DataSection: synthetic key(s) {missing} have no entry under 'Synthetic keys:'")
    rows = [(f"data.{k}", _type(params[k].annotation),
             "required" if params[k].default is inspect.Parameter.empty else _value(params[k].default), synth[k])
            for k in tcfg.DataSection.SYNTHETIC_KEYS]
    return ["### `data`", "", _summary(tcfg.DataSection), "",
            *_table([("data.kind", _type(kind.type), _default(kind), ds["kind"])]),
            "#### `data` with `kind: grain`", "",
            "The other keys are `minimax_jax.data.pipeline.DataConfig` fields: " + _summary(DataConfig), "",
            *_table(_dataclass_rows(DataConfig, "data.")),
            "#### `data` with `kind: synthetic`", "", *_table(rows),
            "#### `data` with `kind: trajectory`", "",
            "The other keys are `minimax_jax.data.trajectories.TrajectoryConfig` fields: " + _summary(TrajectoryConfig),
            "", *_table(_dataclass_rows(TrajectoryConfig, "data."))]


def _mesh_section() -> list[str]:
    f = {x.name: x for x in dataclasses.fields(tcfg.TrainConfig)}["mesh"]
    return ["### `mesh`", "", *_table([("mesh", _type(f.type), _default(f),
                                        _described(tcfg.TrainConfig)["mesh"])])]


def _sections() -> list[str]:
    out = []
    for name, cls in tcfg.SECTIONS.items():
        out += [f"### `{name}`", "", _summary(cls), "", *_table(_dataclass_rows(cls, f"{name}."))]
        if name == "msa":
            keys = ", ".join(f"`{f.name}`" for f in dataclasses.fields(ModelConfig) if f.name.startswith("index_"))
            out += [f"`msa.index` (nested mapping) takes these Model config keys: {keys}.", ""]
    return out


def _sharding() -> list[str]:
    with open(SHARDING_YAML, encoding="utf-8") as f:
        text = f.read()
    doc = yaml.safe_load(text)
    comments, group, in_rules = {}, "", False
    for line in text.splitlines():
        if re.match(r"^\w", line):
            in_rules = line.startswith("rules:")
        m = re.match(r"^\s+# ---- (.*)$", line)
        if in_rules and m:
            group = m.group(1).strip()
        m = re.match(r"^\s+(\w+):[^#]*(?:#\s*(.*))?$", line)
        if m and in_rules:
            comments[m.group(1)] = (group.rstrip("s") + " axis" + (": " + m.group(2) if m.group(2) else "")).strip()
    rules = sharding.load_rules("default").as_dict()
    axes = ", ".join(sharding.MESH_AXES)
    rows = [(f"rules.{k}", "null | mesh axis | list", _value(v[0] if len(v) == 1 else list(v)) if v else "null",
             comments.get(k, ""))
            for k, v in rules.items()]
    rows += [("presets.<name>.mesh", "str", "", "the preset's recommended mesh (MeshSpec string)."),
             ("presets.<name>.rules", "mapping", "{}", "rule overrides applied on top of `rules`.")]
    presets = ", ".join(f"`{n}` ({p.get('mesh')})" for n, p in (doc.get("presets") or {}).items())
    return ["## Sharding rules", "",
            f"`configs/sharding.yaml` (or a file of the same format): logical axis names -> mesh axes ({axes}); "
            "null = replicated, a list = sharded over the product of the axes (the first major). "
            f"Training uses `default`; `infer.py --sharding_rules` picks a preset or a file. Shipped presets: {presets}.", "",
            *_table(rows)]


def render() -> str:
    """The whole of docs/CONFIG.md."""
    head = ["# Configuration reference", "",
            f"Generated from the code by `{REGENERATE}`; do not edit by hand "
            "(tests/test_config_docs.py fails when the two differ). YAML: `null` = none, lists as `[a, b]`.", ""]
    parts = head + _model() + _train_intro() + _model_section() + _data_section() + _mesh_section()
    return "\n".join(parts + _sections() + _sharding()).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
