"""Markers: `gpu` tests skip without CUDA, `vllm` tests skip without the vllm package, `browser` tests
without Chromium (Debian's `chromium` package)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from reflow.config.schema import TinyModelConfig


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
