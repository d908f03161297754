"""``reflow serve``: a Prefect server and the deployments a person launches runs from in its UI.

Starts ``prefect server start`` on ``host:port`` (or uses the server at
``api_url``), then serves three deployments from this process, each flow run
in a child process: ``train/<experiment>`` for each ``configs/*.toml`` (the
form: every config field, prefilled from that file), ``evaluate/evaluate`` (a
finished run's final model) and ``bench/modes`` (the mode comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from reflow.cli.runtime import quiet_environment
from reflow.config.load import InputError
from reflow.infra.prefect_api import watch

HEALTH_TIMEOUT_S = 90.0


class ServeError(Exception):
    """The server cannot be started or reached; the message says what to change."""


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port``; InputError naming --host or --port if it cannot be
    bound for another reason (a host that is no address of this machine, a port that needs root)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise InputError(f"--host {host!r}: not an address or host name ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            if exc.errno == errno.EADDRNOTAVAIL:
                raise InputError(f"--host {host!r}: not an address of this machine") from None
            raise InputError(f"--port {port} on {host}: cannot listen there ({exc.strerror})") from None
    return False


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect API at ``api_url`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_server(host: str, port: int) -> subprocess.Popen:
    """``prefect server start`` on ``host:port``; returns once its API answers."""
    if port_in_use(host, port):
        raise ServeError(f"port {port} on {host} is already in use: pass --port with a free port, or "
                         f"--api-url http://{host}:{port}/api to use a Prefect server already running there")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": f"http://{host}:{port}/api"}
    # a session of its own: a terminal's Ctrl-C reached the server too, and the runner, pausing the deployments on
    # its way out, retried the stopped server for a minute; this process stops it, or the watchdog if it dies
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watch(proc.pid)
    api_url = f"http://{host}:{port}/api"
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while not healthy(api_url):
        if proc.poll() is not None:
            raise ServeError(f"prefect server exited with code {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise ServeError(f"prefect server did not answer at {api_url} within {HEALTH_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
    return proc


def deployments(out_dir: str) -> list:
    """The served deployments (imported here: ``PREFECT_API_URL`` must be set first).

    ``train/<name>`` for each experiment file ``configs/<name>.toml`` (its form prefilled with the file's
    resolved config; ``train/default`` is ``reflow run``'s default), ``evaluate/evaluate`` and ``bench/modes``,
    whose parameters are ``reflow evaluate``'s and ``reflow bench``'s, with runs and output under ``out_dir``.
    """
    from prefect.deployments.runner import EntrypointType

    from reflow.flows.bench import bench_flow
    from reflow.flows.launch import (
        CONFIGS,
        evaluate_run,
        experiment_files,
        experiment_summary,
        form_values,
        train_flow,
    )

    module = EntrypointType.MODULE_PATH
    runs = [f"run.out_dir={json.dumps(out_dir)}"]
    served = [train_flow.to_deployment(name=name, entrypoint_type=module, tags=["reflow"],
                                       parameters=form_values(path, runs),
                                       description=f"{experiment_summary(path)} (configs/{name}.toml; every field "
                                                   f"can be changed in the form)")
              for name, path in experiment_files().items()]
    bench = {"config": str(CONFIGS / "bench.toml"), "set": [], "seeds": [0], "output": os.path.join(out_dir, "bench"),
             "modes": ["sync", "one_step_off", "async", "reflow", "sorted_on_policy", "sorted_partial"],
             "target_accuracy": None, "smooth_evals": 3, "equal_steps": False}
    return served + [
        evaluate_run.to_deployment(name="evaluate", entrypoint_type=module, tags=["reflow"],
                                   parameters={"runs": out_dir},
                                   description="Held-out accuracy of a finished run's final model, as "
                                               "`reflow evaluate RUN`: a run id under runs, or a run directory."),
        bench_flow.to_deployment(name="modes", entrypoint_type=module, tags=["reflow"], parameters=bench,
                                 description="The same workload under each mode, as `reflow bench`: "
                                             "bench.json and bench.png in the output folder.")]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _runner():
    """``prefect.serve``'s runner, stopped by SIGTERM as by Ctrl-C.

    Prefect's own SIGTERM handler calls the coroutine ``Runner.stop`` without awaiting it ("coroutine
    'Runner.astop' was never awaited") and exits from inside the signal handler; raising
    KeyboardInterrupt instead unwinds ``Runner.start``, which pauses the deployments on its way out.
    """
    from prefect.runner import Runner

    class _Runner(Runner):
        def handle_sigterm(self, *args: object, **kwargs: object) -> None:
            raise KeyboardInterrupt

    return _Runner(pause_on_shutdown=True)


def serve(host: str, port: int, api_url: str | None, out_dir: str) -> int:
    """Start or connect to the server, serve the deployments until interrupted."""
    server = None
    if api_url:
        if not healthy(api_url):
            raise ServeError(f"no Prefect API answers at {api_url} (is the server running? the URL ends in /api)")
    else:
        print(f"starting a Prefect server on {host}:{port} ...", flush=True)
        server = start_server(host, port)
        api_url = f"http://{host}:{port}/api"
    os.environ["PREFECT_API_URL"] = api_url
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: the server started here goes down with us
    ui = api_url.rstrip("/").removesuffix("/api")
    try:
        runner = _runner()
        served = deployments(out_dir)
        for deployment in served:
            runner.add_deployment(deployment)
        print(f"Prefect UI: {ui}  (deployments: {ui}/deployments)\nserving "
              + ", ".join(f"{d.flow_name}/{d.name}" for d in served) + "; Ctrl-C stops", flush=True)
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    if args.api_url:
        url = urllib.parse.urlparse(args.api_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise InputError(f"--api-url {args.api_url!r}: expected the server's API URL, "
                             f"http(s)://HOST:PORT/api")
    if not args.api_url and port_in_use(args.host, args.port):
        raise InputError(f"port {args.port} on {args.host} is already in use: pass --port with a free port, or "
                         f"--api-url http://{args.host}:{args.port}/api to use a Prefect server already running there")
    # flow-run logs (progress lines) go to the UI, even when the caller's environment quietened Prefect
    os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
    quiet_environment(False)
    try:
        return serve(args.host, args.port, args.api_url, str(Path(args.runs).resolve()))
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
