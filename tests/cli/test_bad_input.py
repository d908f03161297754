"""`reflow run`, `resume` and `model init` refuse bad input with exit 2 before they write anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reflow.cli import main as cli
from reflow.cli.runtime import preflight
from reflow.config.load import InputError, config_to_json, load_config
from reflow.infra.run import FINISHED, RunOutcome, write_finished


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _run_dir(root: Path, overrides: list[str], record: str | None) -> Path:
    run_dir = root / "runs" / "r-20260101-000000-000"
    run_dir.mkdir(parents=True)
    cfg = load_config(None, [f"run.out_dir={json.dumps(str(root / 'runs'))}",
                             f"model.cache_dir={json.dumps(str(root / 'models'))}", *overrides])
    (run_dir / "config.json").write_text(config_to_json(cfg))
    if record is not None:
        (run_dir / "run.json").write_text(record)
    return run_dir


@pytest.mark.parametrize("uri,needle", [
    ("bogus://x", "tracking.tracking_uri: MLflow has no tracking store for 'bogus://x'"),
    ("file:///tmp/mlruns", "tracking.tracking_uri: tracking URI 'file:///tmp/mlruns' is an MLflow file store"),
])
def test_preflight_refuses_a_tracking_uri_mlflow_cannot_use(tmp_path: Path, uri: str, needle: str) -> None:
    cfg = load_config(None, [f"run.out_dir={json.dumps(str(tmp_path / 'runs'))}", f"tracking.tracking_uri={uri}"])
    with pytest.raises(InputError, match=needle):
        preflight(cfg)
    for fine in ("none", "sqlite:////tmp/x/mlflow.db", "http://localhost:5000"):
        preflight(cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": fine})}))
    assert list(tmp_path.iterdir()) == []


def test_run_with_a_bad_tracking_uri_exits_2_and_makes_no_run(tmp_path: Path, capsys) -> None:
    assert cli.main(["run", "--set", "tracking.tracking_uri=bogus://x", "--runs", str(tmp_path / "runs")]) == 2
    assert "tracking.tracking_uri" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("record,overrides,needle", [
    ("[]", [], "run.json: not a reflow run record"),
    ('{"run_id": 5}', [], "run.json: not a reflow run record"),
    ('{"run_id": "r"}', ["tracking.tracking_uri=bogus://x"], "tracking.tracking_uri"),
    ('{"run_id": "r"}', ['model.cache_dir="/dev/null/models"'], "model.cache_dir: '/dev/null' is a file"),
])
def test_resume_refuses_a_bad_record_or_what_a_new_run_would_refuse(tmp_path: Path, capsys, record: str,
                                                                    overrides: list[str], needle: str) -> None:
    run_dir = _run_dir(tmp_path, overrides, record)
    before = _listing(tmp_path)
    assert cli.main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert _listing(tmp_path) == before


def test_resume_of_a_finished_run_says_so_and_starts_nothing(tmp_path: Path, capsys) -> None:
    # a model cache a new start would refuse: the finished run is recognised before anything is started
    run_dir = _run_dir(tmp_path, ['model.cache_dir="/dev/null/models"'], '{"run_id": "r"}')
    write_finished(RunOutcome(run_dir=str(run_dir), mlflow_run_id="m1", tracking_ui="http://ui", store_root="s",
                              curves_png="c.png", final_model=str(run_dir / "final_model"), steps=3,
                              finished_at="2026-01-01T00:00:00+00:00"))
    before = _listing(tmp_path)
    assert cli.main(["resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "reflow resume r: the run finished at 2026-01-01T00:00:00+00:00 after 3 steps; nothing to resume" in out
    assert f"final model   : {run_dir / 'final_model'}" in out and "MLflow run    : m1" in out
    assert _listing(tmp_path) == before

    (run_dir / FINISHED).write_text('{"run_dir": 1}')
    assert cli.main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / FINISHED}: not a reflow run outcome" in err and "Traceback" not in err, err


def test_model_init_under_a_file_exits_2_naming_the_field(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["model", "init", "--set", f"model.cache_dir={json.dumps(str(afile / 'x'))}"]) == 2
    assert "model.cache_dir:" in capsys.readouterr().err
    assert afile.read_text() == "x" and _listing(tmp_path) == ["afile"]
