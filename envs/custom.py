"""``custom``: your own prompts and your own reward function, named in the config.

```toml
[env]
kind = "custom"
data_path = "data/train.jsonl"                   # rows: prompt (text or chat messages), answer (optional)
reward_function = "my_rewards.py:exact_answer"   # a file, or an importable module: "my_pkg.rewards:exact"
```

Rows (parquet or jsonl, split and rendered as for ``math``; ``envs/datasets.py``):
``prompt``, a string or a list of ``{role, content}`` chat messages (or
``question``, a string), and optionally ``answer``, any value, handed to the
reward as a string (JSON for anything but a string).

The reward function, one call per response::

    def exact_answer(prompt: str, response: str, answer: str) -> float | bool | tuple[float, bool]

``prompt`` is the rendered prompt text, ``response`` the decoded response,
``answer`` the row's answer ("" without one). It returns the reward (a
number, or a bool: 1.0 or 0.0), or ``(reward, correct)``; without an explicit
``correct``, a response is correct when its reward is at least 1.0. With
``env.reward_batched = true`` it is called once per batch with three lists and
returns a list of such values, for rewards that are cheaper together (a model,
a service, a sandbox pool).

The function is imported once per process that scores (the driver: scoring
runs in the flow's tasks), so a file path is resolved against the directory
``reflow`` starts in. A dataset has no reference solutions, so a custom
workload trains a model of your own (``model.path``), not the tiny default.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from reflow.envs.base import Prompt, Score
from reflow.envs.datasets import DatasetError, Row, RowEnv, parse_messages


class RewardFunctionError(ValueError):
    """``env.reward_function`` cannot be loaded, or returned something that is not a reward."""


@functools.lru_cache(maxsize=8)
def load_reward_function(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names: ``path/to/file.py:name`` or ``package.module:name``."""
    source, sep, name = spec.rpartition(":")
    if not sep or not source or not name.isidentifier():
        raise RewardFunctionError(f"env.reward_function: expected 'module:function' or 'file.py:function', "
                                  f"got {spec!r}")
    try:
        if source.endswith(".py") or "/" in source:
            path = Path(source).resolve()
            if not path.is_file():
                raise RewardFunctionError(f"env.reward_function: no file {str(path)!r}")
            module_spec = importlib.util.spec_from_file_location(f"reflow_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
    except RewardFunctionError:
        raise
    except Exception as exc:  # the user's module failed to import: say where
        raise RewardFunctionError(f"env.reward_function: importing {source!r} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"env.reward_function: {source!r} has no function {name!r}")
    return fn


def to_score(value: Any, where: str) -> Score:
    """A reward function's return value as a ``Score`` (a number, a bool, or ``(reward, correct)``)."""
    if isinstance(value, tuple) and len(value) == 2:
        reward, correct = value
        return Score(reward=float(to_score(reward, where).reward), correct=bool(correct))
    if isinstance(value, bool):
        return Score(reward=float(value), correct=value)
    if isinstance(value, (int, float)):
        return Score(reward=float(value), correct=float(value) >= 1.0)
    raise RewardFunctionError(f"{where}: returned {type(value).__name__} {str(value)[:60]!r}; expected a number, a "
                              "bool or (reward, correct)")


class CustomEnv(RowEnv):
    """Dataset rows scored by the function ``env.reward_function`` names (module docstring)."""

    name = "custom"

    def __init__(self, cfg: Any, seed: int, tokenizer: Any = None) -> None:
        if cfg.reward_function is None:
            raise RewardFunctionError("env.kind = 'custom' needs env.reward_function")
        self.reward = load_reward_function(cfg.reward_function)
        super().__init__(cfg, seed, tokenizer)

    @classmethod
    def parse_row(cls, raw: dict[str, Any], where: str) -> Row:
        """A row with ``prompt`` (text or chat messages) or ``question``, and an optional ``answer``."""
        if raw.get("prompt") is not None:
            messages = parse_messages(raw["prompt"], where)
        elif raw.get("question") is not None:
            messages = (("user", str(raw["question"])),)
        else:
            raise DatasetError(f"{where}: missing column 'prompt' (or 'question'); has: "
                               f"{', '.join(sorted(raw)) or 'none'}")
        answer = raw.get("answer")
        answer = "" if answer is None else answer if isinstance(answer, str) else json.dumps(answer)
        return Row(messages=messages, answer=answer, reference=None, key=json.dumps([messages, answer]))

    def synthetic_row(self, rng: random.Random) -> dict[str, Any]:
        raise DatasetError("env.kind = 'custom' has no built-in dataset: set env.data_path")

    def score(self, prompt: Prompt, response_text: str) -> Score:
        return self.score_many([prompt], [response_text])[0]

    def score_many(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> list[Score]:
        """One call per response, or one per batch with ``env.reward_batched``."""
        if len(prompts) != len(texts):
            raise ValueError(f"score_many: {len(prompts)} prompts but {len(texts)} texts")
        where = f"env.reward_function {self.cfg.reward_function}"
        if self.cfg.reward_batched:
            values = self.reward([p.text for p in prompts], list(texts), [p.answer for p in prompts])
            if not isinstance(values, (list, tuple)) or len(values) != len(prompts):
                raise RewardFunctionError(f"{where}: a batched reward must return one value per response "
                                          f"({len(prompts)}), got {str(values)[:60]!r}")
            return [to_score(v, where) for v in values]
        return [to_score(self.reward(p.text, text, p.answer), where) for p, text in zip(prompts, texts)]
