"""Convert the raw text of a ``<parameter>`` value to a Python value using its JSON schema.

The renderer writes strings verbatim and every other value as JSON, so the parser reverses that
by the declared type:

| schema type | accepted text | result |
|---|---|---|
| "string" (or no schema / unknown type) | anything | the text unchanged |
| "integer" | optional sign + digits (JSON integer; "3.0" is refused) | int |
| "number" | a finite JSON number | int if written without fraction/exponent, else float |
| "boolean" | true / false (any case) | bool |
| "null" | null / none (any case) | None |
| "object" / "array" | JSON text of that kind | dict / list |

A union (``"type": [...]``, ``anyOf``, ``oneOf``) tries each non-string member in the order
given, then falls back to the text if "string" is a member. Failure raises ``ArgumentTypeError``
with the reason; the parser turns that into a structured error entry.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

__all__ = ["ArgumentTypeError", "convert_argument", "schema_types"]

_INT = re.compile(r"[+-]?\d+\Z")


class ArgumentTypeError(ValueError):
    """The text of a parameter does not match its declared JSON-schema type."""


def schema_types(schema: Any) -> list[str]:
    """Declared JSON types of ``schema`` in order ([] when none is declared)."""
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += [x for x in schema_types(sub) if x not in out]
    return out


def _convert_one(text: str, kind: str) -> Any:
    s = text.strip()
    if kind == "integer":
        if not _INT.match(s):
            raise ArgumentTypeError(f"expected an integer, got {text!r:.60}")
        return int(s)
    if kind == "number":
        if _INT.match(s):
            return int(s)
        try:
            v = json.loads(s)
        except json.JSONDecodeError:
            v = None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ArgumentTypeError(f"expected a finite number, got {text!r:.60}")
        return v
    if kind == "boolean":
        if s.lower() in ("true", "false"):
            return s.lower() == "true"
        raise ArgumentTypeError(f"expected true or false, got {text!r:.60}")
    if kind == "null":
        if s.lower() in ("null", "none"):
            return None
        raise ArgumentTypeError(f"expected null, got {text!r:.60}")
    if kind in ("object", "array"):
        try:
            v = json.loads(s)
        except json.JSONDecodeError as e:
            raise ArgumentTypeError(f"expected JSON {kind}: {e}") from None
        want = dict if kind == "object" else list
        if not isinstance(v, want):
            raise ArgumentTypeError(f"expected JSON {kind}, got {type(v).__name__}")
        return v
    return text  # "string" and unknown types


def convert_argument(text: str, schema: Any) -> Any:
    """Typed value of ``text`` for the property ``schema`` (see module table).

    Raises ArgumentTypeError when no declared type accepts the text.
    """
    kinds = schema_types(schema)
    if not kinds or "string" in kinds and len(kinds) == 1:
        return text
    errors = []
    for kind in kinds:
        if kind == "string":
            continue
        try:
            return _convert_one(text, kind)
        except ArgumentTypeError as e:
            errors.append(str(e))
    if "string" in kinds or not any(k in _KNOWN for k in kinds):
        return text
    raise ArgumentTypeError("; ".join(errors))


_KNOWN = {"integer", "number", "boolean", "null", "object", "array", "string"}
