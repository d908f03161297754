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
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(cwd / "prefect"),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
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


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_serve_and_its_server_in_seconds(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: when it stopped the server too, the runner retried the
    stopped server while pausing the deployments, and serve took 70 s to exit."""
    import time

    import psutil

    proc = _serve(_free_port(), tmp_path)
    try:
        for line in proc.stdout:
            if line.startswith("serving "):
                break
        else:
            pytest.fail(f"reflow serve exited with code {proc.wait()}")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "no Prefect server started"
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "stopped" in output, output
    assert seconds < 30, f"serve took {seconds:.0f} s to stop"
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], alive


def _train_deployments(out_dir: Path) -> dict:
    from reflow.cli.serve import deployments

    return {d.name: d for d in deployments(str(out_dir)) if d.flow_name == "train"}


def _filled(parameters: dict) -> dict:
    """The section models a submitted train form holds (Prefect's own validation of the parameters)."""
    from reflow.flows.launch import train_flow

    return train_flow.validate_parameters(parameters)


def test_train_deployments_are_the_experiment_files_prefilled(tmp_path: Path) -> None:
    from reflow.config.load import load_config
    from reflow.flows.launch import CONFIGS, form_config, train_flow

    served = _train_deployments(tmp_path)
    assert sorted(served) == sorted(p.stem for p in CONFIGS.glob("*.toml"))
    runs = [f"run.out_dir={json.dumps(str(tmp_path))}"]
    for name, deployment in served.items():
        # submitted unchanged, a form runs exactly its experiment file (with runs under serve's folder)
        assert form_config(_filled(deployment.parameters)) == load_config(CONFIGS / f"{name}.toml", runs), name
    # train/default is what `reflow run` runs with no --config
    assert form_config(_filled(served["default"].parameters)) == load_config(None, runs)
    schema = train_flow.parameters.model_dump()
    assert list(schema["properties"])[:3] == ["mode", "run", "rollout"]  # the headline choice first
    assert all(prop.get("description") for prop in schema["properties"].values())
    # typed inputs: a field may be left empty (a None toggle) only where its real default is None
    for section in schema["definitions"].values():
        for field, prop in section["properties"].items():
            nullable = any(option.get("type") == "null" for option in prop.get("anyOf", []))
            assert nullable == (prop.get("default", "absent") is None), f"{section['title']}.{field}"
            assert "<" not in prop.get("description", ""), f"{section['title']}.{field}: the UI drops <tags>"


def test_train_form_switched_to_another_workload_takes_its_defaults(tmp_path: Path) -> None:
    from reflow.config.load import ConfigError, load_config
    from reflow.flows.launch import form_config

    values = _train_deployments(tmp_path)["default"].parameters
    math = _filled({**values, "env": {**values["env"], "kind": "math"}})
    assert form_config(math) == load_config(None, ["env.kind='math'", f"run.out_dir={json.dumps(str(tmp_path))}"])
    # sections that do not fit together: the flow run fails with a message that names the fields
    sorted_async = {**values, "mode": {"kind": "async"},
                    "rollout": {**values["rollout"], "scheduling": "sorted_on_policy"}}
    with pytest.raises(ConfigError,
                       match=r"(?s)the train form.*rollout.scheduling='sorted_on_policy' needs mode.kind='sync'"):
        form_config(_filled(sorted_async))


def test_evaluate_and_bench_forms_take_the_cli_flags(tmp_path: Path) -> None:
    from reflow.cli.main import build_parser
    from reflow.cli.serve import deployments

    served = {d.flow_name: d for d in deployments(str(tmp_path)) if d.flow_name != "train"}
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {cmd: {a.option_strings[0].removeprefix("--").replace("-", "_") if a.option_strings else a.dest
                   for a in subcommands[cmd]._actions if a.dest != "help" and a.help != "==SUPPRESS=="
                   and not a.__class__.__name__.startswith("_Renamed")}
             for cmd in ("evaluate", "bench")}
    bench = served["bench"].parameters
    assert set(bench) == flags["bench"] - {"verbose"}, (sorted(bench), sorted(flags["bench"]))
    assert set(served["evaluate"]._parameter_openapi_schema.properties) == flags["evaluate"] - {"verbose"}
    assert served["evaluate"].parameters == {"runs": str(tmp_path)} and bench["output"] == str(tmp_path / "bench")


def _field(page, label: str):
    """The innermost form property labelled ``label`` (Prefect's schema form)."""
    title = page.locator("span.schema-form-property__label",
                         has_text=re.compile(f"^{re.escape(label)}( \\(Optional\\))?$"))
    return page.locator("div.schema-form-property", has=title).last


def _custom_run(page, ui: str, deployment: str) -> None:
    """Open deployment ``deployment``'s Custom run form."""
    page.goto(f"{ui}/deployments")
    page.get_by_role("link", name=deployment, exact=True).first.click()
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run").click()
    page.locator("span.schema-form-property__label").first.wait_for()


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


def _open_new_run(page, tries: int = 4) -> None:
    """On the deployment page a Submit leads to, open the flow run it created, reloading between tries.

    On a loaded CI machine the deployment's Runs list once did not show the new run within 30 s (its list
    is polled); a reload asks the server afresh, so a run that was never created still fails the test.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_url(re.compile(r".*/deployments/deployment/.*"))
    for attempt in range(tries):
        try:
            page.locator("a[href*='/runs/flow-run/']").first.click(timeout=20_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise
            page.reload()


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
            for name in ("default", "smoke", "math", "evaluate", "modes"):  # train/<experiment file>, evaluate, bench
                page.get_by_role("link", name=name, exact=True).first.wait_for()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=ARTIFACTS / "0-deployments.png", full_page=True)
            _custom_run(page, ui, "smoke")
            # the form: mode first, typed fields prefilled from configs/smoke.toml; 2 steps, the transformers engine
            labels = page.locator("span.schema-form-property__label").all_inner_texts()
            assert [label.removesuffix(" (Optional)") for label in labels[:3]] == ["mode", "Kind", "run"], labels[:5]
            steps = _field(page, "Total Steps").locator("input")
            assert steps.input_value() == "3"  # configs/smoke.toml's
            steps.fill("2")
            engine = _field(page, "Engine")
            engine.locator("button.p-select-button__control").click()
            page.keyboard.press("ArrowDown")  # opens the option list
            page.get_by_role("option", name="transformers", exact=True).click()
            page.screenshot(path=ARTIFACTS / "1-train-form.png", full_page=True)
            page.get_by_role("button", name="Submit", exact=True).click()
            # the new run in the deployment's Runs tab, then its page: wait for Completed
            _open_new_run(page)
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
            # evaluate the finished run by its id, as `reflow evaluate RUN`
            (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if (p / "run.json").is_file()]
            _custom_run(page, ui, "evaluate")
            assert _field(page, "runs").locator("textarea, input").first.input_value() == str(tmp_path / "runs")
            _field(page, "run").locator("textarea, input").first.fill(run_dir.name)
            page.screenshot(path=ARTIFACTS / "5-evaluate-form.png", full_page=True)
            page.get_by_role("button", name="Submit", exact=True).click()
            _open_new_run(page)
            page.locator(".state-badge", has_text="Completed").first.wait_for(timeout=300_000)
            _shown(page, re.compile(f"{re.escape(run_dir.name)}: held-out accuracy [01][.][0-9]{{3}}"))
            page.screenshot(path=ARTIFACTS / "6-evaluate-run.png", full_page=True)
            # bench's form: reflow bench's flags, the output under serve's runs folder
            _custom_run(page, ui, "modes")
            labels = {label.removesuffix(" (Optional)") for label in
                      page.locator("span.schema-form-property__label").all_inner_texts()}
            assert labels == {"config", "set", "modes", "seeds", "output", "target_accuracy", "smooth_evals",
                              "equal_steps"}, labels
            page.screenshot(path=ARTIFACTS / "7-bench-form.png", full_page=True)
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    # the run the form launched: 2 steps in Delta and MLflow
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
