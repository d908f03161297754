"""`reflow reproduce`: the record, its checks, the comparison, and a real repeat of a tiny run (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reflow.cli import main as cli
from reflow.cli.reproduce import check_inputs, compare, is_timing_metric, weight_difference
from reflow.config.schema import ReflowConfig
from reflow.infra.provenance import MANIFEST_ARTIFACT, finish_manifest, start_manifest, write_manifest
from reflow.storage.tracker import MLflowTracker

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(path: Path, scale: float) -> Path:
    path.mkdir(parents=True)
    torch.save({"model": {"w": torch.arange(6.0).reshape(2, 3) * scale, "b": torch.zeros(3)}, "version": 1},
               path / "trainer.pt")
    return path


def test_compare_metrics_and_weights(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a/step-000001", 1.0)
    b = _checkpoint(tmp_path / "b/step-000001", 1.5)
    assert weight_difference(a, a) == 0.0
    assert weight_difference(a, b) == pytest.approx(2.5)  # 5 * 1.5 - 5
    original = {0: {"loss": 0.5, "reward_mean": 0.25}, 1: {"loss": 0.4, "reward_mean": 0.5}}
    same = compare(original, {k: dict(v) for k, v in original.items()}, [{"step": 1, "path": str(a)}],
                   [{"step": 1, "path": str(a)}], tolerance=0.0)
    assert same.matched and same.steps_compared == 2 and same.metrics == {"loss": 0.0, "reward_mean": 0.0}
    off = compare(original, {0: {"loss": 0.5, "reward_mean": 0.25}, 1: {"loss": 0.41, "reward_mean": 0.5}},
                  [{"step": 1, "path": str(a)}], [{"step": 1, "path": str(b)}], tolerance=0.02)
    assert off.metrics["loss"] == pytest.approx(0.01) and off.checkpoints[1] == pytest.approx(2.5)
    assert not off.matched  # the weights differ by more than the tolerance
    short = compare(original, {0: original[0]}, [], [], tolerance=1.0)
    assert short.missing == ["step 1"] and not short.matched


def test_timing_metrics_are_excluded() -> None:
    assert is_timing_metric("step_seconds") and is_timing_metric("generated_tokens_per_s")
    assert is_timing_metric("trainer_idle_fraction") and is_timing_metric("rollout_bubble_ratio")
    assert not is_timing_metric("clip_fraction") and not is_timing_metric("loss")


@pytest.fixture
def recorded(tmp_path: Path) -> dict:
    """An MLflow store with a run whose manifest points at a model directory and two checkpoints."""
    out = tmp_path / "runs"
    run_dir = out / "orig-20260101-000000-000"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = ReflowConfig.model_validate({"run": {"out_dir": str(out)}, "model": {"path": str(model)}})
    manifest = start_manifest(cfg.model_dump(mode="json"), run_dir.name, str(model), "path", {"usage": -1})
    for step in (1, 2):
        _checkpoint(run_dir / "checkpoints" / f"step-{step:06d}", float(step))
    manifest = finish_manifest(manifest, run_dir / "checkpoints", {"usage": 3}, [])
    tracker = MLflowTracker(f"sqlite:///{out / 'mlflow.db'}", "reflow")
    run_id = tracker.start(run_dir.name, {}, {})
    tracker.log_artifact(write_manifest(run_dir, manifest), "reproduce")
    tracker.log_metrics({"loss": 0.5}, step=0)
    tracker.end()
    bare = MLflowTracker(f"sqlite:///{out / 'mlflow.db'}", "reflow")
    bare_id = bare.start("not-reflow", {}, {})
    bare.end()
    (run_dir / "run.json").write_text(json.dumps({"tracking_uri": f"sqlite:///{out / 'mlflow.db'}",
                                                  "mlflow_run_id": run_id, "store_root": str(run_dir / "tables")}))
    return {"out": out, "run_id": run_id, "bare_id": bare_id, "run_dir": run_dir, "model": model}


def test_code_and_package_differences_are_warnings(recorded: dict) -> None:
    manifest = json.loads((recorded["run_dir"] / "manifest.json").read_text())
    assert check_inputs(manifest, compare_checkpoints=True) == []  # recorded here, now: nothing differs
    manifest["packages"]["torch"] = "0.0.1"
    manifest["code"]["git_revision"] = "f" * 40
    warnings = check_inputs(manifest, compare_checkpoints=True)
    assert f"package torch: recorded 0.0.1, now {torch.__version__}" in warnings
    assert any(w.startswith(f"code git_revision: recorded {'f' * 40}") for w in warnings)


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_reproduce_bad_input_exits_2_and_starts_nothing(recorded: dict, tmp_path: Path, capsys) -> None:
    out, run_dir = recorded["out"], recorded["run_dir"]
    ckpt = run_dir / "checkpoints/step-000002/trainer.pt"
    cases = [
        ([recorded["run_id"], "--runs", str(tmp_path / "elsewhere")], "no MLflow store at"),
        (["0123456789abcdef0123456789abcdef", "--runs", str(out)], "no MLflow run '0123456789abcdef"),
        ([recorded["bare_id"], "--runs", str(out)], f"has no readable {MANIFEST_ARTIFACT}"),
        ([str(tmp_path / "model")], "not a run directory"),
        ([recorded["run_id"], "--runs", str(out), "--tracking-uri", "sqlite:///x.db"], "not both"),
        ([recorded["run_id"], "--runs", str(out), "--tolerance", "-1"], "--tolerance"),
    ]
    for name, content in (("empty", b""), ("text", b"not sqlite")):  # MLflow would write into the empty one
        (tmp_path / name).mkdir()
        (tmp_path / name / "mlflow.db").write_bytes(content)
        cases.append(([recorded["run_id"], "--runs", str(tmp_path / name)], "is not an MLflow store"))
    before = _listing(out)
    for args, message in cases:
        code = cli.main(["reproduce", *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (args, err)
    assert not (tmp_path / "elsewhere").exists()
    assert [(tmp_path / n / "mlflow.db").read_bytes() for n in ("empty", "text")] == [b"", b"not sqlite"]
    assert _listing(out) == before  # no new run directory, nothing rewritten

    # a corrupt checkpoint (one byte changed, same size), then a missing one; the run dir works as the argument
    data = bytearray(ckpt.read_bytes())
    data[-1] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    before = _listing(out)
    code = cli.main(["reproduce", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint of step 2 is corrupt" in err and "--no-checkpoints" in err
    assert _listing(out) == before
    (run_dir / "checkpoints/step-000001/trainer.pt").unlink()
    before = _listing(out)
    code = cli.main(["reproduce", recorded["run_id"], "--runs", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint of step 1 is missing" in err
    assert _listing(out) == before  # no new run directory, nothing rewritten

    # the model the run started from changed
    (recorded["model"] / "config.json").write_text('{"changed": true}')
    code = cli.main(["reproduce", recorded["run_id"], "--runs", str(out), "--no-checkpoints"])
    err = capsys.readouterr().err
    assert code == 2 and "changed since the run" in err
    assert _listing(out) == before


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(cwd / "prefect"),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    return subprocess.run([sys.executable, "-m", "reflow.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_reproduce_repeats_a_sync_run_exactly(tmp_path: Path, engine: str) -> None:
    """Sync mode, CPU, fixed seed: the repeat matches the original bit for bit, with either engine.

    120 warm-start steps and a format reward give rewards that differ within groups, so the policy
    learns (non-zero gradients) and the checkpoint comparison means something.
    """
    out = tmp_path / "runs"
    overrides = ["--set", f'rollout.engine="{engine}"', "--set", "model.tiny.sft_steps=120",
                 "--set", "env.format_reward=0.5", "--set", f'model.cache_dir="{tmp_path / "models"}"']
    proc = _run(["run", "--config", str(REPO / "configs/smoke.toml"), "--runs", str(out), *overrides], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
    assert not (run_dir / "writer.lock").exists()  # released on a clean exit
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["seed"] == 0 and manifest["packages"]["torch"]
    assert manifest["code"]["package_version"] and manifest["model"]["source"] == "tiny"
    assert [c["step"] for c in manifest["checkpoints"]] == [1, 2]
    assert manifest["tables"]["final"]["usage"] == 3 and len(manifest["tables"]["written_per_step"]) == 3
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert any(s["metrics"]["grad_norm"] > 0 for s in steps), "the run must learn for the weights check to mean much"
    mlflow_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]

    proc = _run(["reproduce", mlflow_id, "--runs", str(out), "--check"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MATCHED" in proc.stdout and "Traceback" not in proc.stderr
    repeat_dir = next(p for p in out.iterdir() if (p / "reproduce.json").is_file())
    report = json.loads((repeat_dir / "reproduce.json").read_text())
    assert report["matched"] and report["steps_compared"] == 3 and report["original"] == mlflow_id
    assert set(report["max_abs_weight_diff_per_checkpoint"]) == {"1", "2"}
    assert {"loss", "reward_mean", "entropy", "grad_norm", "eval_accuracy"} <= set(report["max_abs_diff_per_metric"])
    assert all(v == 0.0 for v in report["max_abs_diff_per_metric"].values())

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    repeat = client.get_run(report["repeat"])
    assert repeat.data.tags["reflow.reproduces"] == mlflow_id
    assert repeat.data.tags["reflow.pkg.torch"] == torch.__version__


def test_a_record_that_is_not_an_object_or_a_store_mlflow_cannot_open_exits_2(tmp_path: Path, capsys,
                                                                              monkeypatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("[]")
    assert cli.main(["reproduce", str(run_dir)]) == 2
    assert "run.json is not a reflow run record" in capsys.readouterr().err
    assert cli.main(["reproduce", "abc", "--tracking-uri", "bogus://x"]) == 2
    assert "no tracking store for 'bogus://x': pass --tracking-uri" in capsys.readouterr().err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://y")
    assert cli.main(["reproduce", "abc"]) == 2
    assert "no tracking store for 'bogus://y'" in capsys.readouterr().err
    assert [p.name for p in tmp_path.rglob("*")] == ["run", "run.json"]
