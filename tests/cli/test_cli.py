"""Bad input exits with code 2, names the problem, and creates nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _reflow(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reflow.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ})


def test_help_is_fast_and_lists_commands(tmp_path: Path) -> None:
    proc = _reflow("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "run" in proc.stdout and "model" in proc.stdout
    check = subprocess.run([sys.executable, "-c", "import sys, reflow.cli.main; "
                            "print(sorted(m for m in ('torch','ray','vllm','prefect') if m in sys.modules))"],
                           capture_output=True, text=True)
    assert check.stdout.strip() == "[]"  # nothing heavy imported to parse arguments


def test_bad_override_exits_2_and_names_field(tmp_path: Path) -> None:
    proc = _reflow("run", "--set", "rollout.samples_per_prompt=0", "--runs", "runs", cwd=tmp_path)
    assert proc.returncode == 2
    assert "rollout.samples_per_prompt" in proc.stderr and "greater than or equal to 1" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_unknown_field_in_file_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\nprompts_per_stepp = 4\n")
    proc = _reflow("run", "--config", str(bad), "--runs", "runs", cwd=tmp_path)
    assert proc.returncode == 2 and "rollout.prompts_per_stepp" in proc.stderr and "unknown field" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_invalid_toml_and_missing_file_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    assert _reflow("run", "--config", str(bad), cwd=tmp_path).returncode == 2
    proc = _reflow("run", "--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_missing_model_path_exits_2(tmp_path: Path) -> None:
    proc = _reflow("run", "--set", f'model.path="{tmp_path / "no-model"}"', "--runs", "runs", cwd=tmp_path)
    assert proc.returncode == 2 and "model.path" in proc.stderr and "does not exist" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _reflow("run", "--set", f'model.path="{empty}"', "--runs", "runs", cwd=tmp_path)
    assert proc.returncode == 2 and "no config.json" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_unreadable_table_path_exits_2(tmp_path: Path) -> None:
    root = tmp_path / "tables"
    (root / "trajectories").mkdir(parents=True)
    (root / "trajectories" / "junk.parquet").write_text("not a delta table")
    proc = _reflow("run", "--set", f'storage.root="{root}"', "--runs", "runs", cwd=tmp_path)
    assert proc.returncode == 2 and "storage.root" in proc.stderr and "trajectories" in proc.stderr
    assert (root / "trajectories" / "junk.parquet").read_text() == "not a delta table"
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = _reflow("run", "--set", f'storage.root="{afile}"', cwd=tmp_path)
    assert proc.returncode == 2 and "storage.root" in proc.stderr


def test_bench_bad_input_exits_2_and_creates_nothing(tmp_path: Path) -> None:
    cases = [(["--modes", "sync,warp"], "unknown mode"), (["--seeds", "0,x"], "--seeds"),
             (["--target-accuracy", "1.5"], "--target-accuracy"),
             (["--set", "buffer.replay_ratio=2"], "buffer.replay_ratio"),
             (["--set", "env.eval_prompts=0"], "env.eval_prompts")]
    for extra, message in cases:
        proc = _reflow("bench", "--output", "b", *extra, cwd=tmp_path)
        assert proc.returncode == 2, (extra, proc.stderr)
        assert message in proc.stderr, (extra, proc.stderr)
        assert not (tmp_path / "b").exists()


def test_bench_sampler_bad_input_exits_2_and_builds_nothing(tmp_path: Path) -> None:
    for extra, message in [(["--rows", "10"], "--rows"), (["--rows-per-version", "12"], "--rows-per-version"),
                           (["--rows", "2000", "--rows-per-version", "4000"], "--rows-per-version")]:
        proc = _reflow("bench-sampler", "--root", "buf", *extra, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (extra, proc.stderr)
        assert not (tmp_path / "buf").exists()


def test_bad_dataset_exits_2_before_anything_is_written(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["run", "--runs", "runs", "--set", "env.kind=code", "--set", f'model.path="{model}"']
    proc = _reflow(*base, "--set", f'env.data_path="{tmp_path / "missing.jsonl"}"', cwd=tmp_path)
    assert proc.returncode == 2 and "env.data_path" in proc.stderr and "no such file" in proc.stderr
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"prompt": "x", "tests": "[]"}\n')
    proc = _reflow(*base, "--set", f'env.data_path="{wrong}"', cwd=tmp_path)
    assert proc.returncode == 2 and "row 0: missing column 'question'" in proc.stderr, proc.stderr
    math_rows = tmp_path / "math.jsonl"
    math_rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    proc = _reflow(*base, "--set", f'env.data_path="{math_rows}"', cwd=tmp_path)  # math rows for the code env
    assert proc.returncode == 2 and "missing column 'input_output'" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_resume_of_a_missing_run_exits_2(tmp_path: Path) -> None:
    proc = _reflow("resume", "no-such-run", "--runs", "runs", cwd=tmp_path)
    assert proc.returncode == 2 and "'no-such-run' is not a run directory" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_run_resume_refuses_a_new_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    proc = _reflow("run", "--resume", str(run_dir), "--set", "run.total_steps=3", cwd=tmp_path)
    assert proc.returncode == 2 and "drop --config and --set" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == []



def test_interrupt_that_surfaces_as_another_exception_still_exits_130(monkeypatch, capsys) -> None:
    """Ctrl-C landing inside Prefect's crash handler came out as ValueError("Task run is not set") (CI, exit 1)."""
    import signal

    from reflow.cli import main as cli
    from reflow.infra import signals

    def handler(args: object) -> int:
        try:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # whatever handler main installed
        except KeyboardInterrupt:
            raise ValueError("Task run is not set") from None
        return 0

    monkeypatch.setattr(signals, "INTERRUPTED", signals.threading.Event())
    monkeypatch.setattr(cli, "INTERRUPTED", signals.INTERRUPTED)
    monkeypatch.setattr(cli, "cmd_config", handler)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main(["config"]) == 130
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
    assert "interrupted" in capsys.readouterr().err


def test_after_a_stop_signal_logged_errors_lose_their_traceback(monkeypatch) -> None:
    """Prefect logs the exception an interrupt became with its traceback (CI); after the signal, one line."""
    import io
    import logging
    import signal

    import pytest

    from reflow.infra import signals

    monkeypatch.setattr(signals, "INTERRUPTED", signals.threading.Event())
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log = logging.getLogger("reflow-test.flow_runs")
    log.addHandler(handler)
    try:
        def fail(tag: str) -> None:
            try:
                raise ValueError("Task run is not set")
            except ValueError:
                log.error("%s: encountered exception during execution", tag, exc_info=True)

        fail("before")
        assert "Traceback" in out.getvalue()
        with pytest.raises(KeyboardInterrupt):
            signals.raise_interrupt(signal.SIGTERM, None)
        out.truncate(0)
        out.seek(0)
        fail("after")
        assert out.getvalue() == "after: encountered exception during execution\n"
    finally:
        log.removeHandler(handler)


def test_an_error_without_an_interrupt_is_not_reported_as_one(monkeypatch) -> None:
    import signal

    import pytest

    from reflow.cli import main as cli
    from reflow.infra import signals

    def handler(args: object) -> int:
        raise ValueError("a real bug")

    monkeypatch.setattr(signals, "INTERRUPTED", signals.threading.Event())
    monkeypatch.setattr(cli, "INTERRUPTED", signals.INTERRUPTED)
    monkeypatch.setattr(cli, "cmd_config", handler)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(ValueError, match="a real bug"):
            cli.main(["config"])
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def test_run_as_a_script_the_handler_ray_reinstalls_sets_the_flag_main_reads(tmp_path: Path) -> None:
    """``python -m reflow.cli.main`` is ``__main__``; ``start_ray`` imports the package module again.

    Both must share one flag, or a Ctrl-C after Ray started exits 1 (seen in CI).
    """
    script = (
        "import importlib.util, signal, sys\n"
        "spec = importlib.util.find_spec('reflow.cli.main')\n"
        "script = importlib.util.module_from_spec(spec)  # a second module object, as __main__ is\n"
        "spec.loader.exec_module(script)\n"
        "import reflow.cli.main as package\n"
        "assert script is not package\n"
        "def handler(args):\n"
        "    package.interrupt_on_signals()  # as start_ray re-installs them, through the package module\n"
        "    try:\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "    except KeyboardInterrupt:\n"
        "        raise ValueError('Task run is not set') from None\n"
        "script.cmd_config = handler\n"
        "sys.exit(script.main(['config']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr


@pytest.fixture
def tmpfs(tmp_path: Path):
    """Mount a small tmpfs (``options`` such as ``ro`` or ``size=64k``) under ``tmp_path``; unmounted afterwards."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the disk cases need one")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.mark.parametrize("options, message", [
    ("ro,size=1m", "run.out_dir: cannot write under"),
    ("size=64k", "MiB free; a run needs at least 64 MiB"),
], ids=["read-only", "full"])
def test_an_unwritable_or_full_output_directory_is_one_line_and_exit_2(tmpfs, tmp_path: Path, options: str,
                                                                       message: str) -> None:
    disk = tmpfs("disk", options)
    if "size=64k" in options:  # fill what little there is, as a full disk would be
        (disk / "fill").write_bytes(b"\0" * 32 * 1024)
    before = sorted(p.name for p in disk.iterdir())
    proc = _reflow("run", "--runs", str(disk / "runs"), "--set", "run.total_steps=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in disk.iterdir()) == before  # nothing written


def test_a_disk_error_behind_a_failure_is_found() -> None:
    import errno as errno_

    from reflow.cli.runtime import disk_error

    full = OSError(errno_.ENOSPC, "No space left on device", "/runs/x/steps.jsonl")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("the feeder loop failed") from exc
    except RuntimeError as wrapped:
        assert disk_error(wrapped) is full
    assert disk_error(ValueError("no")) is None and disk_error(OSError(errno_.ENOENT, "gone")) is None


def test_version_and_a_closed_pipe(tmp_path: Path) -> None:
    from reflow import __version__

    assert _reflow("--version", cwd=tmp_path).stdout.strip() == f"reflow {__version__}"
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli.main", "config", "--reference"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the command writes (`reflow config | head`, head done)
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and stderr == "", stderr


def test_evaluate_needs_a_finished_run(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    proc = _reflow("evaluate", "r1", "--runs", str(tmp_path / "runs"), cwd=tmp_path)
    assert proc.returncode == 2 and "has no final model" in proc.stderr and "Traceback" not in proc.stderr
    (run / "final_model").mkdir()
    (run / "final_model" / "config.json").write_text("{}")
    (run / "run.json").write_text('{"run_id": "r1"}')  # a record without the rest of its fields
    proc = _reflow("evaluate", "r1", "--runs", str(tmp_path / "runs"), cwd=tmp_path)
    assert proc.returncode == 2 and "run.json: not a reflow run record" in proc.stderr, proc.stderr
    assert "store_root: Field required" in proc.stderr and "Traceback" not in proc.stderr


def test_one_grammar_and_its_reference(tmp_path: Path) -> None:
    """docs/cli.md is the parser's; `--runs` is the folder of runs and `--output` what is written, in every
    command that has them; the old flags are refused naming the new ones (exit 2, nothing written)."""
    from reflow.cli.main import cli_reference

    assert (REPO / "docs" / "cli.md").read_text() == cli_reference(), (
        "docs/cli.md is stale: regenerate it with the command at its top")
    rows = [line.strip("| ").split(" | ") for line in cli_reference().splitlines() if line.startswith("| `reflow")]
    for command, argument, meaning in rows:
        if argument.startswith("`--runs`"):
            assert "folder" in meaning, (command, meaning)
        if argument.startswith("`--output"):
            assert "write" in meaning or "go" in meaning, (command, meaning)
        assert not argument.startswith(("`--out`", "`--run`")), (command, argument)
    assert {r[0] for r in rows if r[1].startswith("`RUN")} >= {"`reflow resume`", "`reflow evaluate`",
                                                                "`reflow query`", "`reflow maintain`"}
    for argv, hint in ((["run", "--out", "runs"], "--out is now --runs DIR"),
                       (["query", "SELECT 1", "--run", "r"], "--run is now a positional RUN"),
                       (["bench", "--out", "b"], "--out is now --output")):
        proc = _reflow(*argv, cwd=tmp_path)
        assert proc.returncode == 2 and hint in proc.stderr, (argv, proc.stderr)
    assert not any(tmp_path.iterdir())
    # the run after the SQL, also behind a flag (argparse alone refuses that order): looked up, not refused
    proc = _reflow("query", "SELECT 1", "--max-rows", "3", "nope", "--runs", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "'nope'" in proc.stderr and "unrecognized" not in proc.stderr, proc.stderr
