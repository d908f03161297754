"""``reflow serve``: launch a run from the Prefect UI's form in headless Chromium and watch it complete."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from reflow.storage.metrics import mlflow_name

REPO = Path(__file__).resolve().parents[2]
# Screenshots of the browser test: the form, the run's page, its task runs (kept after the test; gitignored).
ARTIFACTS = Path(os.environ.get("REFLOW_TEST_ARTIFACTS", REPO / ".test-artifacts")) / "prefect-ui"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(port: int, cwd: Path) -> subprocess.Popen:
    # an environment as quiet as a `reflow run` leaves it (in-process tests before this one set it)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(cwd / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen([sys.executable, "-m", "reflow.cli.main", "serve", "--port", str(port),
                             "--runs", str(cwd / "runs")], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_serve_on_a_port_in_use_exits_2(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve(port, tmp_path)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert f"port {port} on 127.0.0.1 is already in use" in output and "--port" in output
    assert not (tmp_path / "prefect").exists()


def _field(page, label: str):
    """The innermost form property labelled ``label`` (Prefect's schema form)."""
    title = page.locator("span.schema-form-property__label", has_text=re.compile(f"^{re.escape(label)}( \\(Optional\\))?$"))
    return page.locator("div.schema-form-property", has=title).last


def _shown(page, text, tries: int = 4) -> None:
    """Wait for ``text`` in the run page's Logs tab, reloading the page between tries.

    On a loaded CI machine the Logs tab of a Completed run once did not show the run's first line within
    30 s; a reload fetches the logs afresh, so a line that never reached the server still fails the test.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(tries):
        try:
            page.get_by_text(text).first.wait_for(timeout=20_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise
            page.reload()
            page.get_by_text("Logs", exact=True).click()


@pytest.mark.slow
@pytest.mark.browser
def test_launch_a_run_from_the_prefect_ui(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    port = _free_port()
    server = _serve(port, tmp_path)
    ui = f"http://127.0.0.1:{port}"
    try:
        for line in server.stdout:  # wait until the deployments are served
            if line.startswith("serving "):
                break
        else:
            pytest.fail(f"reflow serve exited with code {server.wait()}")
        executable = shutil.which("chromium") or shutil.which("chromium-browser")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{ui}/deployments")
            page.get_by_role("link", name="train", exact=True).first.click()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").click()
            # the form: experiment file "smoke" (the default), 2 steps, the transformers engine
            assert _field(page, "experiment").locator("button.p-select-button__control").inner_text() == "smoke"
            steps = _field(page, "Total Steps")
            steps.get_by_role("button", name="int", exact=True).click()
            steps.locator("input").fill("2")
            engine = _field(page, "Engine")
            engine.locator("button.p-select-button__control").click()
            page.keyboard.press("ArrowDown")  # opens the option list
            page.get_by_role("option", name="transformers", exact=True).click()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=ARTIFACTS / "1-train-form.png", full_page=True)
            page.get_by_role("button", name="Submit", exact=True).click()
            # the new run in the deployment's Runs tab, then its page: wait for Completed
            page.wait_for_url(re.compile(r".*/deployments/deployment/.*"))
            page.locator("a[href*='/runs/flow-run/']").first.click()
            page.wait_for_url(re.compile(r".*/runs/flow-run/.*"))
            page.locator(".state-badge", has_text="Completed").first.wait_for(timeout=300_000)
            _shown(page, "mode=sync steps=2")  # the Logs tab
            page.screenshot(path=ARTIFACTS / "2-train-run.png", full_page=True)
            # the training flow is a subflow run: its task runs and progress lines
            page.get_by_text("Subflow Runs", exact=True).click()
            page.locator("a[href*='/runs/flow-run/']").last.click()
            page.get_by_text("Task Runs", exact=True).click()
            for stage in ("prepare", "rollout", "update", "finalize"):
                page.get_by_role("link", name=re.compile(f"^{stage}-")).first.wait_for(timeout=30_000)
            page.screenshot(path=ARTIFACTS / "3-rl_train-task-runs.png", full_page=True)
            page.get_by_text("Logs", exact=True).click()
            _shown(page, re.compile(r"step +2/2"))
            page.screenshot(path=ARTIFACTS / "4-rl_train-logs.png", full_page=True)
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    # the run the form launched: 2 steps in Delta and MLflow
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if (p / "run.json").is_file()]
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["run"]["total_steps"] == 2 and cfg["rollout"]["engine"] == "transformers"
    assert cfg["rollout"]["prompts_per_step"] == 4  # from configs/smoke.toml
    rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table()
    assert rows.num_rows == 2 * cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, mlflow_name("reward_mean"))] == [0, 1]
    with socket.socket() as sock:  # the server went down with reflow serve
        assert sock.connect_ex(("127.0.0.1", port)) != 0
