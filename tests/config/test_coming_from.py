"""docs/coming-from.md maps verl's and TRL's keys onto reflow's fields: each field it names exists, with the default
it shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

from reflow.config.load import load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "coming-from.md"
FIELD = re.compile(r"`([a-z_]+)\.([a-z_]+)`(?: \(([^)]*)\))?")  # `section.field`, then maybe its default


def _reflow_column() -> list[str]:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split("|")][1] for row in rows]


def _shown_matches(shown: str, value: object) -> bool:
    """``shown`` is the doc's default (before any ``: explanation``), ``value`` the schema's."""
    text = shown.split(":")[0].strip()
    if value is None:
        return text == "unset"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return text == json.dumps(value)
    try:
        return float(text) == float(value)
    except ValueError:
        return False


def test_every_reflow_field_named_exists_with_the_default_shown() -> None:
    cfg = load_config(None, [])
    named, wrong = 0, []
    for cell in _reflow_column():
        for section, field, shown in FIELD.findall(cell):
            named += 1
            part = getattr(cfg, section, None)
            if part is None or field not in type(part).model_fields:
                wrong.append(f"{section}.{field}: no such field")
            elif shown and not _shown_matches(shown, getattr(part, field)):
                wrong.append(f"{section}.{field}: shown ({shown}), default {getattr(part, field)!r}")
    assert named > 60 and not wrong, wrong


def test_the_check_catches_a_wrong_default_and_an_unknown_field() -> None:
    cfg = load_config(None, [])
    assert _shown_matches("0.28", cfg.train.clip_eps_high) and not _shown_matches("0.2", cfg.train.clip_eps_high)
    assert _shown_matches('"token_mean"', cfg.train.loss_agg) and not _shown_matches('"seq_mean"', cfg.train.loss_agg)
    assert _shown_matches("unset: off", cfg.train.clip_ratio_c)
    assert FIELD.findall("`train.clip_eps_low` (0.2) and `rollout.nope`") == [
        ("train", "clip_eps_low", "0.2"), ("rollout", "nope", "")]
