"""The configuration reference (docs/configuration.md), rendered from the pydantic schema.

``reflow config --reference`` prints it; a test fails when the committed
file differs from what the schema renders, so the reference cannot go stale.
Each section is one table: the dotted key, its type or allowed values, its
default, its bounds and its description, in the schema's field order.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from reflow.config.schema import ReflowConfig

HEADER = """# Configuration reference

Every field of the config tree (`config/schema.py`), section by section.
An experiment is a TOML file that sets some of them (`configs/*.toml`); the
rest keep these defaults. Override any field on the command line with
`--set section.field=value` (a TOML literal: `--set rollout.prompts_per_step=16`,
`--set mode.kind='"reflow"'` or plain `--set mode.kind=reflow`), and print
the resolved tree with `reflow config --config FILE`. A bad value exits with
code 2 and names the field.

This page is generated: `reflow config --reference > docs/configuration.md`
(a test fails when it is stale).
"""


def _type_name(annotation: Any) -> str:
    """``int``, ``float``, one of ``'a'``, ``'b'``, or ``str`` or unset, ..."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(parts) < len(typing.get_args(annotation))
        return " \\| ".join(_type_name(a) for a in parts) + (" or unset" if optional else "")
    return getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> str:
    """The field's bounds as ``>= 1, <= 100`` (empty when unbounded)."""
    words = {Ge: (">=", "ge"), Gt: (">", "gt"), Le: ("<=", "le"), Lt: ("<", "lt"),
             MinLen: ("length >=", "min_length"), MaxLen: ("length <=", "max_length")}
    out = []
    for item in info.metadata:
        for kind, (symbol, attr) in words.items():
            if isinstance(item, kind):
                out.append(f"{symbol} {getattr(item, attr):,}" if isinstance(getattr(item, attr), int)
                           else f"{symbol} {getattr(item, attr)}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    return "unset" if value is None else f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(prefix: str, model: type[BaseModel], out: list[str]) -> None:
    """One table for ``model``'s leaf fields, then its sub-sections."""
    doc = (model.__doc__ or "").strip()
    if doc.startswith(("Usage docs", "!!!")) or model.__doc__ == BaseModel.__doc__:
        doc = ""
    rows, nested = [], []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((f"{prefix}.{name}", annotation))
            continue
        rows.append(f"| `{prefix}.{name}` | {_type_name(annotation)} | {_default(info)} | {_bounds(info)} | "
                    f"{_cell(info.description or '')} |")
    out.append(f"## `{prefix}`\n")
    if doc:
        out.append(doc.splitlines()[0] + "\n")
    if rows:
        out += ["| key | type | default | bounds | description |", "|---|---|---|---|---|", *rows, ""]
    for key, sub in nested:
        _section(key, sub, out)


def reference_markdown() -> str:
    """docs/configuration.md as the schema renders it."""
    out = [HEADER]
    for name, info in ReflowConfig.model_fields.items():
        _section(name, info.annotation, out)
    return "\n".join(out).rstrip() + "\n"
