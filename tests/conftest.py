"""Markers: `gpu` tests skip without CUDA, `vllm` tests skip without the vllm package."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_vllm = importlib.util.find_spec("vllm") is not None
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    for item in items:
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
