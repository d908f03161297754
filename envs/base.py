"""The workload contract: prompts with ground truth, reference solutions, a verifiable reward.

An ``Env`` is a pure, seeded function of indices: ``prompts(split, start, count)``
returns the same prompts for the same seed and indices in any process, so a
resumed run continues the stream at ``start`` and an evaluation set is fixed.
``make_env`` picks the implementation named by ``EnvConfig.kind``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from reflow.infra.config import EnvConfig

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a workload.

    ``text`` is exactly what is tokenized as the prompt (no chat template is
    applied); ``answer`` is the ground-truth final answer as a string.
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


def check_range(split: str, start: int, count: int) -> None:
    """Raise ValueError with a readable message for a bad ``prompts`` request."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")


def make_env(cfg: "EnvConfig", seed: int) -> Env:
    """The workload named by ``cfg.kind``, seeded with ``seed``."""
    if cfg.kind == "arith":
        from reflow.envs.arith import ArithEnv

        return ArithEnv(cfg, seed)
    if cfg.kind == "tool_calc":
        from reflow.envs.tool_calc import ToolCalcEnv

        return ToolCalcEnv(cfg, seed)
    raise ValueError(f"env.kind: unknown workload {cfg.kind!r}")
