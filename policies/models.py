"""Which model a run trains, and its tokenizer: a Hugging Face directory, or the tiny warm-started default."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer

from reflow.config.schema import ReflowConfig
from reflow.policies.hub import local_model_dir
from reflow.policies.tiny import ensure_tiny_model


def resolve_model_dir(cfg: ReflowConfig, progress: Callable[[str], None] = print) -> str:
    """``model.path`` (a directory, or a Hub id in the local cache: ``policies.hub``), or the tiny
    warm-started policy, built once and cached by its inputs."""
    if cfg.model.path:
        return str(local_model_dir(cfg.model.path))
    return str(ensure_tiny_model(cfg.model, cfg.env, cfg.run.seed, progress=progress,
                                 threads=cfg.resources.torch_threads).resolve())


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer (loaded once per process and directory)."""
    return AutoTokenizer.from_pretrained(model_dir)
