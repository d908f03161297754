"""``math``: competition-style math with a ``\\boxed{}`` (or ``Answer:``) final answer checked by math-verify.

Rows (parquet or jsonl; see ``envs/datasets.py`` for splits and rendering):

- verl / DAPO-Math-17K format: ``prompt`` (chat messages ``[{role, content}]``),
  ``reward_model`` (``{"ground_truth": ..., "style": "rule"}``), optional
  ``data_source``, ``ability`` and ``extra_info``. ``extra_info.reference``, when
  present, is a reference response (the synthetic rows carry one);
- plain format: ``question`` and ``answer`` (the final answer only); the
  question becomes one user message.

Reward: 1.0 when the response's final answer (last ``\\boxed{}``, else the last
``Answer:`` line) equals the ground truth under ``envs/math_verify.py``'s
policy (``\\frac{6}{4}`` equals ``3/2`` and ``1.5``), ``format_reward`` when
an answer is there but wrong, else 0.

Synthetic dataset (the CPU demo; ``env.data_path`` unset): short word problems
in DAPO chat format, e.g. "Ann shares 6 pens equally among 4 friends. How many
pens does each friend get?" with ground truth ``3/2``. The reference response
is ``"6/4\\n\\boxed{\\frac{6}{4}}"``: the answer is unsimplified, so a right
answer is only recognised through equivalence. Additions and subtractions
have references such as ``"7+5=12\\n\\boxed{12}"``.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from typing import Any

from reflow.envs.base import Prompt, Score
from reflow.envs.datasets import DatasetError, Row, RowEnv, parse_messages, require_columns
from reflow.envs.math_verify import answers_equal, extract_final_answer

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay")
ITEMS = ("apple", "pen", "card", "shell", "coin", "book")
INSTRUCTION = "Put the final answer in \\boxed{}."
_FIRST_INT = re.compile(r"\d+")


class MathEnv(RowEnv):
    """DAPO-style math rows with a math-verify reward."""

    name = "math"

    def score(self, prompt: Prompt, response_text: str) -> Score:
        """1.0 for an equivalent final answer, ``format_reward`` for a wrong one, 0.0 for none."""
        answer = extract_final_answer(response_text)
        if answer is None:
            return Score(reward=0.0, correct=False)
        if answers_equal(answer, prompt.answer):
            return Score(reward=1.0, correct=True)
        return Score(reward=float(self.cfg.format_reward), correct=False)

    @staticmethod
    def corrupt_reference(reference: str, rng: random.Random) -> str:
        """The reference with the first number inside its last ``\\boxed{}`` moved by 1..3 (warm-start noise)."""
        at = reference.rfind("\\boxed{")
        if at < 0:
            return reference
        delta = rng.choice((-3, -2, -1, 1, 2, 3))

        def shift(m: re.Match[str]) -> str:
            value = int(m.group(0))
            return str(value + delta if value + delta >= 0 else value - delta)

        return reference[:at] + _FIRST_INT.sub(shift, reference[at:], count=1)

    @classmethod
    def parse_row(cls, raw: dict[str, Any], where: str) -> Row:
        """A verl/DAPO row or a plain ``question``/``answer`` row as a ``Row``."""
        if "prompt" in raw:
            require_columns(raw, ("prompt", "reward_model"), where)
            messages = parse_messages(raw["prompt"], where)
            reward_model = raw["reward_model"]
            if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
                raise DatasetError(f"{where}: column 'reward_model' must hold a 'ground_truth' "
                                   f"(got {str(reward_model)[:80]!r})")
            truth = str(reward_model["ground_truth"]).strip()
            extra = raw.get("extra_info")
            reference = extra.get("reference") if isinstance(extra, dict) else None
            source = str(raw.get("data_source") or "")
        elif "question" in raw or "answer" in raw:
            require_columns(raw, ("question", "answer"), where)
            messages = (("user", str(raw["question"])),)
            truth, reference, source = str(raw["answer"]).strip(), None, ""
        else:
            raise DatasetError(f"{where}: missing column 'prompt' (verl/DAPO format) or 'question' (plain format); "
                               f"has: {', '.join(sorted(raw)) or 'none'}")
        if not truth:
            raise DatasetError(f"{where}: empty ground truth")
        return Row(messages=messages, answer=truth, reference=reference,
                   key=json.dumps([source, messages, truth]))

    def synthetic_row(self, rng: random.Random) -> dict[str, Any]:
        """One synthetic problem as a verl/DAPO row (see the module docstring)."""
        return synthetic_math_row(rng, self.cfg.max_operand)


def synthetic_math_row(rng: random.Random, max_operand: int) -> dict[str, Any]:
    """An addition, subtraction or fair-share word problem in DAPO format, with a reference in ``extra_info``."""
    name, item, kind = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(("add", "sub", "share"))
    a = rng.randint(1, max_operand)
    if kind == "add":
        b = rng.randint(1, max_operand)
        problem = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?"
        truth, reference = str(a + b), f"{a}+{b}={a + b}\n\\boxed{{{a + b}}}"
    elif kind == "sub":
        a = max(a, 2)
        b = rng.randint(1, a - 1)
        problem = f"{name} has {a} {item}s and gives {b} away. How many {item}s are left?"
        truth, reference = str(a - b), f"{a}-{b}={a - b}\n\\boxed{{{a - b}}}"
    else:
        b = rng.randint(2, 9)
        problem = f"{name} shares {a} {item}s equally among {b} friends. How many {item}s does each friend get?"
        share = Fraction(a, b)
        truth = str(share.numerator) if share.denominator == 1 else f"{share.numerator}/{share.denominator}"
        reference = f"{a}/{b}\n\\boxed{{\\frac{{{a}}}{{{b}}}}}"
    return {"data_source": "reflow-synthetic-math", "ability": "MATH",
            "prompt": [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}],
            "reward_model": {"ground_truth": truth, "style": "rule"},
            "extra_info": {"kind": kind, "reference": reference}}
