"""docs/configuration.md is what the schema renders, and names every field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from reflow.config.reference import reference_markdown
from reflow.config.schema import ReflowConfig

REPO = Path(__file__).resolve().parents[2]


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            keys += _leaf_keys(info.annotation, key + ".")
        else:
            keys.append(key)
    return keys


def test_the_committed_reference_is_what_the_schema_renders() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), (
        "docs/configuration.md is stale: run `reflow config --reference > docs/configuration.md`")


def test_every_field_has_a_row_with_its_default_and_a_description() -> None:
    text = reference_markdown()
    keys = _leaf_keys(ReflowConfig)
    assert len(keys) > 90
    for key in keys:
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
        cells = [c.strip() for c in rows[0].strip("|").split(" | ")]
        assert cells[2] and cells[4], (key, rows[0])  # a default and a description
    assert "| `rollout.prompts_per_step` | int | `32` | >= 1, <= 65,536 |" in text
    assert '`"sync"` \\| `"one_step_off"` \\| `"async"` \\| `"reflow"`' in text


def test_the_command_prints_it_and_refuses_a_config_with_it(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "reflow.cli.main", "config", "--reference"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == reference_markdown()
    done = subprocess.run([*cmd, "--set", "run.seed=1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "drop --config and --set" in done.stderr
