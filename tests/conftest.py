"""Markers: `gpu` tests skip without CUDA, `vllm` tests skip without the vllm package, `browser` tests
without Chromium (Debian's `chromium` package)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_vllm = importlib.util.find_spec("vllm") is not None
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
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))


def chromium_path() -> str | None:
    """The system Chromium (Playwright drives it; no browser download)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")
