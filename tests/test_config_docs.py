"""docs/CONFIG.md is generated from the config dataclasses and matches them; every key a shipped
YAML (configs/*.yaml, configs/train/*.yaml) writes has a row; an undocumented field is refused."""

import dataclasses
import glob
import os
import re

import pytest
import yaml

from minimax_jax.train import config_docs
from tests.paths import REPO_ROOT

CONFIG_MD = os.path.join(REPO_ROOT, "docs", "CONFIG.md")


def _rows() -> set[str]:
    with open(CONFIG_MD, encoding="utf-8") as f:
        return set(re.findall(r"^\| `([^`]+)` \|", f.read(), flags=re.M))


def test_config_md_matches_the_code():
    with open(CONFIG_MD, encoding="utf-8") as f:
        shipped = f.read()
    if shipped != config_docs.render():
        pytest.fail(f"docs/CONFIG.md is out of date with the config classes; regenerate it: {config_docs.REGENERATE}",
                    pytrace=False)


def test_every_key_of_the_shipped_yamls_has_a_row():
    rows = _rows()
    seen = 0
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        if os.path.basename(path) == "sharding.yaml":
            keys = [f"rules.{k}" for k in doc["rules"]]
            keys += [f"presets.<name>.{k}" for p in doc["presets"].values() for k in p]
        else:
            keys = list(doc.get("model", doc))
        missing = [k for k in keys if k not in rows]
        assert not missing, (path, missing)
        seen += len(keys)
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "train", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        for section, body in doc.items():
            assert section in rows, (path, section)        # the section table lists it
            if section == "model" and isinstance(body, dict):
                keys = [f"model.{k}" if k == "name" else k for k in body]   # other keys: Model config rows
            elif isinstance(body, dict):
                keys = [f"{section}.{k}" for k in body]
            else:
                keys = [section]
            missing = [k for k in keys if k not in rows]
            assert not missing, (path, missing)
            seen += len(keys)
    assert seen > 100


def test_every_field_of_every_config_class_has_a_row():
    from minimax_jax.config import ModelConfig
    from minimax_jax.data.pipeline import DataConfig
    from minimax_jax.train.config import SECTIONS

    rows = _rows()
    want = [f.name for f in dataclasses.fields(ModelConfig)]
    want += [f"data.{f.name}" for f in dataclasses.fields(DataConfig)]
    want += [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert [k for k in want if k not in rows] == []


def test_attribute_entries_are_parsed_and_an_undocumented_field_is_refused():
    doc = """Summary.

    Attributes:
      a: first line
        continued.
      b, c: shared text.

    Other:
      d: not an attribute.
    """
    assert config_docs.doc_entries(doc) == {"a": "first line continued.", "b": "shared text.", "c": "shared text."}
    assert config_docs.doc_entries(doc, "Other") == {"d": "not an attribute."}

    def cls(attributes, **fields):
        c = dataclasses.make_dataclass("C", [(n, type(v), dataclasses.field(default=v)) for n, v in fields.items()])
        c.__doc__ = "Summary.\n\n    Attributes:\n" + "".join(f"      {line}\n" for line in attributes)
        return c

    with pytest.raises(ValueError, match=r"\['b'\] have no entry.*config_docs > docs/CONFIG.md"):
        config_docs._dataclass_rows(cls(["a: documented."], a=1, b=2))
    with pytest.raises(ValueError, match=r"names \['gone'\], which are not fields"):
        config_docs._dataclass_rows(cls(["a: documented.", "gone: a field that was removed."], a=1))
    Full = cls(["a: the `a` | b.", "names: many."], a=1, names=("x", "y"))
    assert config_docs._dataclass_rows(Full, "s.") == [("s.a", "int", "1", "the `a` | b."),
                                                        ("s.names", "tuple", "[x, y]", "many.")]
    assert config_docs._table(config_docs._dataclass_rows(Full, "s."))[2] == "| `s.a` | int | `1` | the `a` \\| b. |"
