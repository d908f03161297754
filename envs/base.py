"""The workload contract: prompts with ground truth, reference solutions, a verifiable reward.

An ``Env`` is a pure, seeded function of indices: ``prompts(split, start, count)``
returns the same prompts for the same seed and indices in any process, so a
resumed run continues the stream at ``start`` and an evaluation set is fixed.
``make_env`` picks the implementation named by ``EnvConfig.kind`` (``WORKLOADS``).

Scoring comes in batches too: ``score_many(prompts, texts)`` scores a round's
responses at once, so a workload whose reward is expensive (``code`` runs
programs in a sandbox) can fan the work out (Ray tasks) instead of scoring one
response after another. ``BatchScoring`` gives every env the plain loop.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

from reflow.config.schema import EnvConfig

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a workload.

    ``text`` is exactly what is tokenized as the prompt (a chat template, if the
    workload uses one, already applied); ``answer`` is what the reward checks
    against, as a string (arith, math: the final answer; code: the tests as JSON).
    """

    prompt_id: str
    env: str
    text: str
    answer: str


@dataclass(frozen=True)
class Score:
    """The verifiable reward of one response; ``correct`` means the final answer matched."""

    reward: float
    correct: bool


class Env(Protocol):
    """A workload: a deterministic prompt stream per split plus a reward."""

    name: str

    def prompts(self, split: Split, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start+count-1`` of ``split``; deterministic given the env seed."""
        ...

    def reference_solution(self, prompt: Prompt) -> str:
        """The ideal response text (without the end-of-sequence token); used for SFT."""
        ...

    def score(self, prompt: Prompt, response_text: str) -> Score:
        """Reward of ``response_text`` (decoded response, special tokens removed)."""
        ...

    def score_many(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> list[Score]:
        """``[score(p, t) for p, t in zip(prompts, texts)]``, possibly computed in parallel."""
        ...


class BatchScoring:
    """Mixin: ``score_many`` as a loop over ``score`` (for envs whose reward is cheap)."""

    def score_many(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> list[Score]:
        """One ``score`` call per response, in order."""
        if len(prompts) != len(texts):
            raise ValueError(f"score_many: {len(prompts)} prompts but {len(texts)} texts")
        return [self.score(p, t) for p, t in zip(prompts, texts)]  # type: ignore[attr-defined]


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process and Python version (sha256's first bytes)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def check_range(split: str, start: int, count: int) -> None:
    """Raise ValueError with a readable message for a bad ``prompts`` request."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")


# The workloads by ``env.kind``: module and class, imported when a run asks for one (their modules import this
# one). ``custom`` is the plug-in: the user's prompts and reward function (``envs.custom``).
WORKLOADS: dict[str, str] = {
    "arith": "reflow.envs.arith:ArithEnv",
    "math": "reflow.envs.math_env:MathEnv",
    "code": "reflow.envs.code_env:CodeEnv",
    "tool_calc": "reflow.envs.tool_calc:ToolCalcEnv",
    "custom": "reflow.envs.custom:CustomEnv",
}


def env_class(kind: str) -> type:
    """The class of the workload named ``kind`` (imported on demand)."""
    if kind not in WORKLOADS:
        raise ValueError(f"env.kind: unknown workload {kind!r}; one of {', '.join(WORKLOADS)}")
    module, _, name = WORKLOADS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_env(cfg: EnvConfig, seed: int, tokenizer: Any = None) -> Env:
    """The workload named by ``cfg.kind``, seeded with ``seed``.

    ``tokenizer`` (a Hugging Face tokenizer, optional) lets dataset workloads
    apply the model's chat template and measure prompts in its tokens; without
    one, chat messages are joined plainly and lengths count characters (the
    tiny policy's tokenizer is character-level, so both agree for it).
    """
    return env_class(cfg.kind)(cfg, seed, tokenizer)
