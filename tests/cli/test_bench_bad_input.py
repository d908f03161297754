"""``reflow bench``, ``bench-sampler``, ``bench-engine``, ``bench-report`` and ``simulate`` on bad input: exit 2, a
message naming the flag or file, checked before any work, and nothing written or deleted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reflow.bench.sampler import MARKER, check_root
from reflow.cli.main import main

FIXTURE_BENCH = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "sim" / "bench.json"


def reached(*args: object, **kwargs: object) -> None:
    raise AssertionError("the work started before the input was refused")


@pytest.fixture(autouse=True)
def no_work(monkeypatch) -> None:
    """A refusal that came too late fails here, instead of starting a bench, a sampler build or a simulation."""
    import reflow.cli.bench
    import reflow.cli.simulate

    monkeypatch.setattr(reflow.cli.bench, "prefect_api_starting", reached)  # reflow bench: the flow's start
    monkeypatch.setattr(reflow.cli.bench, "quiet_environment", reached)  # bench-engine: before the engine loads
    monkeypatch.setattr(reflow.cli.bench, "bench_sampler", reached)
    monkeypatch.setattr(reflow.cli.simulate, "_run_all", reached)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *names: str) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert all(n in err for n in names), (argv, err)
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("data", [{"runs": []}, {"runs": [], "meta": []}, {"runs": [], "meta": {"overrides": "x"}}])
def test_validate_refuses_a_bench_json_without_its_meta(tmp_path: Path, capsys, data: dict) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(json.dumps(data))
    _refused(["simulate", "--validate", str(tmp_path / "b"), "-o", str(tmp_path / "o")], capsys, "bench.json", "meta")
    assert not (tmp_path / "o").exists()


def test_runs_that_are_not_run_objects_are_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(json.dumps({"runs": ["x"], "meta": {}}))
    _refused(["simulate", "--validate", str(tmp_path / "b"), "-o", str(tmp_path / "o")], capsys, "bench.json", "runs")
    _refused(["bench-report", str(tmp_path / "b")], capsys, "bench.json", "runs")
    assert not (tmp_path / "o").exists()


def test_a_corrupt_trace_file_is_named_with_how_to_rebuild_it(tmp_path: Path, capsys) -> None:
    bench = tmp_path / "b"
    bench.mkdir()
    shutil.copy(FIXTURE_BENCH, bench / "bench.json")
    (bench / "traces.json.gz").write_bytes(b"not gzip")
    _refused(["simulate", "--validate", str(bench), "-o", str(tmp_path / "o")], capsys, "traces.json.gz", "delete it")
    assert (bench / "traces.json.gz").read_bytes() == b"not gzip" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("figures", [[], {"points": "x"},
                                     {"points": [{"concurrency": 8, "tokens_per_s": "x", "step_ms_median": 1.0}]}])
def test_check_engine_refuses_figures_that_are_not_bench_engines(tmp_path: Path, capsys, figures: object) -> None:
    (tmp_path / "bench_engine.json").write_text(json.dumps(figures))
    _refused(["simulate", "--check-engine", str(tmp_path), "-o", str(tmp_path / "o")], capsys, "--check-engine",
             "bench_engine.json")
    assert not (tmp_path / "o").exists()


def test_a_profile_missing_fields_is_one_line_per_field(tmp_path: Path, capsys) -> None:
    (tmp_path / "p.json").write_text('{"name": "x"}')
    err = _refused(["simulate", "--profile", str(tmp_path / "p.json"), "-o", str(tmp_path / "o")], capsys, "p.json",
                   "  engine: Field required", "  lengths: Field required")
    assert "pydantic" not in err and "http" not in err and len(err.splitlines()) == 6


def test_sampler_root_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "f").write_text("mine")
    _refused(["bench-sampler", "--root", str(tmp_path / "f")], capsys, "--root")
    assert (tmp_path / "f").read_text() == "mine"


def test_every_output_is_checked_before_the_work(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("f").write_text("mine")
    _refused(["simulate", "--modes", "sync", "-o", "f/sub"], capsys, "--output", "is a file")
    (tmp_path / "bench_engine.json").write_text(json.dumps({"points": []}))
    _refused(["simulate", "--check-engine", str(tmp_path), "-o", "f/sub"], capsys, "--output")
    _refused(["bench", "-o", "f/sub"], capsys, "--output")
    _refused(["bench-sampler", "--root", "buf", "-o", "f"], capsys, "--output")
    _refused(["bench-sampler", "--root", "buf", "-o", "f/sub"], capsys, "--output")
    _refused(["bench-engine", "--set", 'rollout.engine="vllm"', "-o", "f"], capsys, "--output")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_engine.json", "f"]  # no buf built


def test_the_sampler_bench_uses_and_deletes_only_a_root_it_built(tmp_path: Path, capsys) -> None:
    mine = tmp_path / "mine"
    (mine / "trajectories").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep")
    for rebuild in ([], ["--rebuild"]):
        _refused(["bench-sampler", "--root", str(mine), *rebuild], capsys, "--root", "notes.txt")
    assert (mine / "notes.txt").read_text() == "keep" and (mine / "trajectories").is_dir()
    unmarked = tmp_path / "tables"  # a run's tables, say: neither deleted nor given the bench's rows
    (unmarked / "trajectories").mkdir(parents=True)
    (unmarked / "usage").mkdir()
    for rebuild in ([], ["--rebuild"]):
        _refused(["bench-sampler", "--root", str(unmarked), *rebuild], capsys, "--root", MARKER)
    assert sorted(p.name for p in unmarked.iterdir()) == ["trajectories", "usage"]
    assert not any((unmarked / "usage").iterdir())
    (unmarked / MARKER).write_text("")
    check_root(unmarked, rebuild=False)
    check_root(unmarked, rebuild=True)
    check_root(tmp_path / "new", rebuild=True)
    (tmp_path / "empty").mkdir()
    check_root(tmp_path / "empty", rebuild=True)


def test_bench_checks_every_mode_and_seed_before_any_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _refused(["bench", "-o", "b", "--set", 'env.kind="tool_calc"'], capsys, "sorted_on_policy", "rollout.scheduling")
    _refused(["bench", "-o", "b", "--seeds", "0,-1"], capsys, "--seeds")
    _refused(["bench", "-o", "b", "--seeds", "1,1"], capsys, "--seeds")
    _refused(["bench", "-o", "b", "--modes", "sync,sync"], capsys, "--modes")
    for seeds in ("0,0", "-1"):
        _refused(["simulate", "-o", "s", "--modes", "sync", "--seeds", seeds], capsys, "--seeds")
    _refused(["simulate", "-o", "s", "--modes", "sync,sync"], capsys, "--modes")
    _refused(["bench", "-o", "b", "--set", "run.seed=3"], capsys, "--set run.seed", "--seeds")
    assert not any(tmp_path.iterdir())
    (tmp_path / "b" / "runs" / "async-s1").mkdir(parents=True)
    (tmp_path / "b" / "runs" / "async-s1" / "x").write_text("a run")
    _refused(["bench", "-o", "b", "--seeds", "1"], capsys, "--output", "async-s1")
    assert sorted(p.name for p in (tmp_path / "b" / "runs").iterdir()) == ["async-s1"]


def test_the_bench_flow_checks_its_rows_before_writing(tmp_path: Path, monkeypatch) -> None:
    """The flow (as `reflow serve`'s deployment starts it) refuses the same rows before it makes --output."""
    import reflow.flows.bench
    from reflow.flows.bench import bench_flow

    monkeypatch.setattr(reflow.flows.bench, "bench_mode", reached)  # a row would fail, not run
    with pytest.raises(ValueError, match="sorted_partial"):
        bench_flow.fn(config=None, set=['env.kind="tool_calc"'], modes=["sync", "sorted_partial"], seeds=[0],
                      output=str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()
