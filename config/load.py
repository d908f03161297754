"""Loading the config tree: a TOML file, dotted overrides, validation with errors that name the field.

Overrides (``rollout.prompts_per_step=16``) are applied to the parsed file
before validation, so a bad override is reported exactly like a bad file.
"""

from __future__ import annotations

import copy
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from reflow.config.schema import ReflowConfig

# Fields a config may still carry from an older reflow: what replaced them, and the value that meant "unused"
# (a run's stored config.json has every field, so its runs still load where the field held that value).
RETIRED = {
    "resources.elastic_engines": ("removed: resources.flex_workers does its job on any device (docs/concepts.md, "
                                  "\"The elastic pool\")", 0),
}


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


class InputError(Exception):
    """Bad input to a command (not the config), detected before anything was written; exits with code 2."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:  # TOML literal: numbers, booleans, quoted strings, arrays
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare string such as a path
    return key, value


def format_errors(err: ValidationError, heading: str, config_fields: bool = False) -> str:
    """``heading``, then one line per wrong field: ``  path.to.field: message (got value)``. ``config_fields``: an
    unknown field is named as a config's (retired ones with their replacement)."""
    lines = [heading]
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")  # our validators' messages, without pydantic's label
        if item["type"] == "extra_forbidden" and config_fields:
            msg = RETIRED[path][0] if path in RETIRED else (
                "unknown field (check the spelling; every field: docs/configuration.md or `reflow config`)")
        given = item.get("input")
        shown = "" if isinstance(given, dict) or item["type"] == "missing" else f" (got {given!r})"
        if config_fields and item["type"] == "string_type" and isinstance(given, int | float | bool):
            shown += f"; a string is quoted: \"{json.dumps(given)}\""  # `--set run.name=1` reads a number
        lines.append(f"  {path}: {msg}{shown}" if path else f"  {msg}")  # a cross-field check names its fields
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                text: str | None = None) -> ReflowConfig:
    """Read a TOML file (or nothing: defaults), apply ``key.path=value`` overrides, validate.

    ``text``: the file's contents as stored when it was read (a bench.json keeps the text its runs read), used
    instead of reading ``path``. Raises ConfigError with a message that names the field path and what was expected.
    """
    tree: dict[str, Any] = {}
    source = "defaults"
    if text is not None:
        source = f"{path or 'config'} (as stored)"
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {source!r} is not valid TOML: {exc}") from exc
    elif path is not None:
        source = str(path)
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {source!r} is a directory; give a TOML file")
        if not p.is_file():
            raise ConfigError(f"config file {source!r} does not exist")
        try:
            tree = tomllib.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {source!r} is not UTF-8 text (byte {exc.start}); TOML files are "
                              f"UTF-8") from None
        except OSError as exc:
            raise ConfigError(f"config file {source!r} cannot be read ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {source!r} is not valid TOML: {exc}") from exc
    for item in overrides or []:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    if overrides:
        source += " + overrides"
    return validate_config(tree, source)


def validate_config(tree: dict[str, Any], source: str) -> ReflowConfig:
    """``tree`` (sections of fields) as a config; ConfigError naming each wrong field and ``source``."""
    try:
        return ReflowConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, f"invalid config ({source}):", config_fields=True)) from None


def stored_config(data: str | Mapping[str, Any], source: str) -> ReflowConfig:
    """A config a run stored (its config.json, or a tracked manifest's) as this code reads it: a retired field
    that held its "unused" value is dropped (``RETIRED``); any other value of it is refused, naming what
    replaced it. ConfigError naming ``source`` otherwise, as ``validate_config``."""
    tree = json.loads(data) if isinstance(data, str) else copy.deepcopy(dict(data))
    for dotted, (_, unused) in RETIRED.items():
        *sections, key = dotted.split(".")
        node: Any = tree
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node and node[key] == unused:
            del node[key]
    return validate_config(tree, source)


def config_to_json(cfg: ReflowConfig) -> str:
    """The resolved config as JSON (saved with every run)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)


def flat_params(cfg: ReflowConfig) -> dict[str, str]:
    """The resolved config flattened to dotted keys (MLflow params)."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = str(node)

    walk("", cfg.model_dump(mode="json"))
    return out
