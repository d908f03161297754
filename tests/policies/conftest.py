from __future__ import annotations

from pathlib import Path

import pytest

from reflow.infra.config import EnvConfig, TinyModelConfig


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


@pytest.fixture()
def env_cfg() -> EnvConfig:
    return EnvConfig(max_terms=6)
