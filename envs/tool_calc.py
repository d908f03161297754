"""``tool_calc``: products of large numbers that pay off only with a calculator (code) tool call.

Format (character-level, no chat template)::

    prompt:    "1234*567="
    response:  "<code>print(1234*567)</code>\\n<output>699678</output>\\n#699678"   (then <eos>)

The policy writes the code block; generation stops at ``</code>``; the
sandbox runs it and ``\\n<output>...</output>\\n`` is appended (see
``envs.tools``; those tokens are masked out of the loss); the policy then
copies the result into the answer line. A character-level tiny model cannot
multiply two 3-4 digit numbers in its head, but it can learn to copy.

Operands are uniform in ``100 .. env.max_operand`` (the arith field; at
least 100). Prompts are index-addressable and eval prompts are held out by a
hash of the text exactly as in ``arith``.

Reward: as in ``arith``: the last line must be ``#<integer>``; 1.0 when it
equals the product, ``format_reward`` when well formed but wrong, else 0.

Reference solutions (the warm start's SFT data): for ``DIRECT_SHARE`` of the
prompts (chosen by a hash of the text) the reference answers *without* the
tool, with the product rounded to two significant digits (a plausible guess,
almost always wrong). So the warm-started policy calls the tool only about
``1 - DIRECT_SHARE`` of the time and RL has to learn that the call pays.
"""

from __future__ import annotations

import random
from typing import Any

from reflow.config.schema import EnvConfig
from reflow.envs.arith import ANSWER_MARKER, is_eval_text
from reflow.envs.base import BatchScoring, Prompt, Score, Split, check_range, stable_hash
from reflow.envs.tools import CODE_CLOSE, CODE_OPEN, format_output

MIN_OPERAND = 100
DIRECT_SHARE = 0.25  # share of reference solutions that guess without the tool
TOOL_OUTPUT_CHARS = 64  # output length the references are written with (a product fits easily)
_MAX_DRAWS = 10_000


def _rounded(value: int, digits: int = 2) -> int:
    """``value`` rounded to ``digits`` significant digits."""
    scale = 10 ** max(0, len(str(value)) - digits)
    return (value + scale // 2) // scale * scale


class ToolCalcEnv(BatchScoring):
    """Two-factor products, solved with one ``print(a*b)`` tool call."""

    name = "tool_calc"

    def __init__(self, cfg: EnvConfig, seed: int, tokenizer: Any = None) -> None:  # prompts are plain text
        if cfg.max_operand < MIN_OPERAND:
            raise ValueError(f"env.kind='tool_calc' needs env.max_operand >= {MIN_OPERAND}, got {cfg.max_operand}")
        self.cfg = cfg
        self.seed = seed

    def prompts(self, split: Split, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start+count-1`` of ``split`` (deterministic, eval held out)."""
        check_range(split, start, count)
        return [self._prompt(split, i) for i in range(start, start + count)]

    def reference_solution(self, prompt: Prompt) -> str:
        """Code block, its output, answer line; or a direct guess for ``DIRECT_SHARE`` of prompts."""
        expr = prompt.text.removesuffix("=")
        if stable_hash("tool-calc-direct/" + prompt.text) % 1000 < DIRECT_SHARE * 1000:
            return f"{ANSWER_MARKER}{_rounded(int(prompt.answer))}"
        output = format_output(prompt.answer, TOOL_OUTPUT_CHARS)
        return f"{CODE_OPEN}print({expr}){CODE_CLOSE}{output}{ANSWER_MARKER}{prompt.answer}"

    def score(self, prompt: Prompt, response_text: str) -> Score:
        """1.0 if the answer line is the product, ``format_reward`` if well formed but wrong, else 0."""
        last = response_text.rstrip().split("\n")[-1]
        if not (last.startswith(ANSWER_MARKER) and last[1:].isdigit()):
            return Score(reward=0.0, correct=False)
        if last[1:] == prompt.answer:
            return Score(reward=1.0, correct=True)
        return Score(reward=float(self.cfg.format_reward), correct=False)

    def _prompt(self, split: Split, index: int) -> Prompt:
        rng = random.Random(stable_hash(f"tool_calc/{split}/{self.seed}/{index}"))
        for _ in range(_MAX_DRAWS):
            a, b = rng.randint(MIN_OPERAND, self.cfg.max_operand), rng.randint(MIN_OPERAND, self.cfg.max_operand)
            text = f"{a}*{b}="
            if is_eval_text(text) == (split == "eval"):
                return Prompt(prompt_id=f"tool_calc-{split}-s{self.seed}-{index:06d}", env=self.name,
                              text=text, answer=str(a * b))
        raise RuntimeError(f"tool_calc: no {split} prompt after {_MAX_DRAWS} draws; raise env.max_operand")
