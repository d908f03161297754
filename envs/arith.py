"""``arith``: long-tailed multi-term sums solved step by step (the CPU default workload).

Format (character-level, no chat template)::

    prompt:    "12+7+30="
    response:  "12+7=19\\n19+30=49\\n#49"      (then the end-of-sequence token)

The response adds the terms left to right, one ``running+term=sum`` line per
term after the first, and ends with the answer line ``#<sum>``.

Distribution: with probability ``1 - long_share`` a sum has ``min_terms``
terms; otherwise it has ``min_terms + 1 + G`` terms, ``G ~ Geometric(tail_p)``
(failures before the first success), capped at ``max_terms``. So
``P(terms >= min_terms + k) = long_share * (1 - tail_p) ** (k - 1)`` for
``k >= 1``. Operands are uniform in ``1 .. max_operand``. Most sums are short
and a few are long, so response lengths have a long tail: with the defaults
(0.4, 0.3) the p99 response over a batch of 256 is about 8x the median (a
plain geometric cannot reach 5x: once the median is a shortest sum its tail
is too light). That tail is the straggler problem the system exists for.

Reward: the response's last line (trailing whitespace removed) must be
``#<integer>``. It scores 1.0 (correct) when the integer equals the true sum
written canonically, ``format_reward`` when the line is well formed but wrong,
and 0.0 otherwise (no answer line, text after it, a truncated response). The
intermediate lines are not checked: the reward is verifiable, not a grader.

Determinism: prompt ``i`` of a split is drawn from its own RNG seeded by a
hash of ``(seed, split, i)``, so streams are index-addressable (a resumed run
continues at ``start``) and train/eval streams are independent. Eval prompts
are held out by construction: a prompt text belongs to eval exactly when a
hash of the text falls in one of ``EVAL_BUCKETS`` buckets (independent of the
seed), and each split rejects draws that belong to the other, so no train
stream of any seed ever contains an eval prompt.
"""

from __future__ import annotations

import random
import re
from typing import Any

from reflow.config.schema import EnvConfig
from reflow.envs.base import BatchScoring, Prompt, Score, Split, check_range, stable_hash

ANSWER_MARKER = "#"
EVAL_BUCKETS = 16  # 1 in 16 possible prompt texts is reserved for eval
_ANSWER_LINE = re.compile(r"#(-?[0-9]+)")
_MAX_DRAWS = 10_000  # rejection-sampling guard; expected draws are 16 for eval, ~1.07 for train


def is_eval_text(text: str) -> bool:
    """Whether a prompt text is reserved for the eval split (seed-independent)."""
    return stable_hash("arith-eval-partition/" + text) % EVAL_BUCKETS == 0


class ArithEnv(BatchScoring):
    """Multi-term addition with a step-by-step reference and an exact-answer reward."""

    name = "arith"

    def __init__(self, cfg: EnvConfig, seed: int, tokenizer: Any = None) -> None:  # prompts are plain text
        self.cfg = cfg
        self.seed = seed

    def prompts(self, split: Split, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start+count-1`` of ``split`` (see the module docstring)."""
        check_range(split, start, count)
        return [self._prompt(split, i) for i in range(start, start + count)]

    def reference_solution(self, prompt: Prompt) -> str:
        """Running-sum lines then ``#<sum>``, e.g. ``"12+7=19\\n19+30=49\\n#49"``."""
        terms = parse_terms(prompt.text)
        lines = []
        total = terms[0]
        for term in terms[1:]:
            lines.append(f"{total}+{term}={total + term}")
            total += term
        lines.append(f"{ANSWER_MARKER}{total}")
        return "\n".join(lines)

    def score(self, prompt: Prompt, response_text: str) -> Score:
        """1.0 if the answer line is right, ``format_reward`` if well formed but wrong, else 0."""
        lines = response_text.rstrip().split("\n")
        match = _ANSWER_LINE.fullmatch(lines[-1])
        if match is None:
            return Score(reward=0.0, correct=False)
        if match.group(1) == prompt.answer:
            return Score(reward=1.0, correct=True)
        return Score(reward=float(self.cfg.format_reward), correct=False)

    def _prompt(self, split: Split, index: int) -> Prompt:
        rng = random.Random(stable_hash(f"arith/{split}/{self.seed}/{index}"))
        want_eval = split == "eval"
        for _ in range(_MAX_DRAWS):
            terms = self._draw_terms(rng)
            text = "+".join(str(t) for t in terms) + "="
            if is_eval_text(text) == want_eval:
                return Prompt(prompt_id=f"arith-{split}-s{self.seed}-{index:06d}", env=self.name,
                              text=text, answer=str(sum(terms)))
        raise RuntimeError(f"arith: no {split} prompt after {_MAX_DRAWS} draws; "
                           "raise env.max_operand or env.max_terms")

    def _draw_terms(self, rng: random.Random) -> list[int]:
        n_terms = self.cfg.min_terms
        if n_terms < self.cfg.max_terms and rng.random() < self.cfg.long_share:
            n_terms += 1
            while n_terms < self.cfg.max_terms and rng.random() >= self.cfg.tail_p:
                n_terms += 1
        return [rng.randint(1, self.cfg.max_operand) for _ in range(n_terms)]


def parse_terms(prompt_text: str) -> list[int]:
    """The operands of an arith prompt such as ``"12+7+30="``."""
    body = prompt_text.removesuffix("=")
    try:
        return [int(part) for part in body.split("+")]
    except ValueError:
        raise ValueError(f"not an arith prompt: {prompt_text!r}") from None
