"""Answer checking for math workloads: ``\\boxed{}`` extraction and equivalence of answers.

Equivalence is decided by Hugging Face's ``math-verify`` package (LaTeX and
plain expressions parsed into SymPy, then compared numerically, symbolically,
as sets/intervals/relations), after a small normalisation of our own. It runs
offline.

Policy (the test table in ``tests/envs/test_math_verify.py`` pins each case):

- equal: ``\\frac{1}{2}`` / ``\\dfrac12`` / ``1/2`` / ``0.5``; ``1,000`` /
  ``1\\,000`` / ``1{,}000`` / ``1 000`` / ``1000`` (thousands separators are
  removed first); ``\\$5`` / ``5``; ``-0`` / ``0``; ``3.0`` / ``3``;
  ``\\sqrt{2}/2`` / ``\\frac{\\sqrt 2}{2}``; units and degrees dropped
  (``5 \\text{ cm}``, ``90^\\circ``); ``\\text{(A)}`` / ``A``; sets in any
  order; ``x=3`` / ``3`` (an assignment to a variable is judged by its value);
- percent is optional: ``5\\%`` equals both ``5`` and ``0.05`` (math-verify's
  choice: datasets write percentages both ways);
- floats are rounded to 6 decimals: ``0.333333`` equals ``1/3``, ``0.33`` does
  not; ``\\pi`` is not ``3.14159``;
- intervals keep their brackets: ``[1,2)`` is not ``(1,2]``;
- no answer, an empty answer or one longer than ``MAX_ANSWER_CHARS`` is wrong.

Time: one check takes milliseconds. math-verify's own timeouts use
``signal.alarm``, which only works in the main thread (elsewhere, e.g. in
Prefect's worker threads, it raises ``ValueError``) and would clobber a
caller's SIGALRM; they are disabled here. Instead, in any thread:

- a check running longer than ``timeout_seconds`` is abandoned (judged
  unequal) by a watchdog thread that raises an exception in the checking
  thread (``PyThreadState_SetAsyncExc``). That takes effect between bytecodes,
  so it cannot stop one long C call;
- the long C calls that answers can trigger are huge exact integers
  (``9^{9^{9^9}}``, ``(10^9)!``, ``2^{2^{30}}``): parsed answers whose exact
  value could exceed ``MAX_EXACT_BITS`` are judged unequal without evaluating
  them (``_exact_bits``), unless the two strings are identical.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import threading
from typing import Callable, TypeVar

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from sympy import Basic, MatrixBase

from reflow.envs.base import Score

MAX_ANSWER_CHARS = 1000
MAX_EXACT_BITS = 2**20  # exact numbers beyond ~315,000 digits are not evaluated (judged unequal)
DEFAULT_TIMEOUT_SECONDS = 2.0  # legitimate checks take < 0.3 s even on a busy 2-core machine
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A thousands separator between digit groups: "1\,000", "1{,}000", "1\!000", "1~000", "1 000".
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d)(?:\\,|\{,\}|\\!|\\ |~| )(?=\d{3}(?!\d))")
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*(?:is)?\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_T = TypeVar("_T")
_FAST_GROWING = frozenset({"factorial", "factorial2", "subfactorial", "binomial", "RisingFactorial",
                           "FallingFactorial", "gamma", "fibonacci", "lucas", "catalan", "bell",
                           "primorial", "multinomial_coefficients"})


class _DisabledTimeoutWarning(logging.Filter):
    """math-verify warns once that its (signal) timeouts are off; ours replace them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DisabledTimeoutWarning())


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``); None if absent.

    Braces are matched (``\\{`` and ``\\}`` are literal, not groups). A last box
    that is never closed (a truncated response) or empty gives None: an earlier
    draft answer is not used instead.
    """
    start, command = max((text.rfind(command), command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if rest.startswith("{"):
        content = _braced(rest)
    elif rest[:1] in (" ", "\t") and rest.strip():
        content = rest.split()[0].rstrip("$.,")  # "\boxed 5"
    else:
        content = None  # "\boxed" at the very end, or "\boxedx" (not the box command)
    if content is None:
        return None
    return content.strip() or None


def _braced(text: str) -> str | None:
    """The content of the brace group that opens ``text``; None if it never closes."""
    depth, i = 0, 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:i]
        i += 1
    return None


def extract_final_answer(text: str) -> str | None:
    """The boxed answer, else the last ``Answer: ...`` line (DAPO-Math-17K's format), else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    if not lines:
        return None
    answer = lines[-1].strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$") and not answer.endswith("\\$"):
        answer = answer.strip("$").strip()
    return answer or None


def normalize_answer(answer: str) -> str:
    """Our normalisation before math-verify: trimmed, thousands separators removed."""
    return _THOUSANDS_SEPARATOR.sub("", answer.strip())


def answers_equal(predicted: str, truth: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> bool:
    """Whether ``predicted`` is an equivalent form of ``truth`` (see the module docstring)."""
    predicted, truth = normalize_answer(predicted), normalize_answer(truth)
    if not predicted or not truth or len(predicted) > MAX_ANSWER_CHARS:
        return False
    if "".join(predicted.split()) == "".join(truth.split()):
        return True
    return _call_with_deadline(lambda: _sympy_equal(predicted, truth), timeout_seconds, default=False)


def _sympy_equal(predicted: str, truth: str) -> bool:
    gold = parse(f"${truth}$", extraction_config=_EXTRACTION, parsing_timeout=None)
    target = parse(f"${predicted}$", extraction_config=_EXTRACTION, parsing_timeout=None)
    if not gold or not target or max(map(_exact_bits, [*gold, *target])) > MAX_EXACT_BITS:
        return False
    return bool(verify(gold, target, timeout_seconds=None))


def _exact_bits(expr: object) -> float:
    """Upper bound on the bits of an exact number that evaluating ``expr`` can produce.

    Huge integer arithmetic (``9^{9^{9^9}}``, ``(10^9)!``) runs inside single C
    calls that the deadline cannot interrupt, so such answers are refused
    before evaluation. Symbols and constants count as 2 bits, floats as 64.
    """
    if isinstance(expr, MatrixBase):
        return max((_exact_bits(item) for item in expr), default=0.0)
    if not isinstance(expr, Basic):
        return 0.0
    if expr.is_Integer:
        return float(int(expr).bit_length())
    if expr.is_Rational:
        return float(max(abs(expr.p).bit_length(), expr.q.bit_length()))
    if expr.is_Float:
        return 64.0
    if not expr.args:
        return 2.0
    bits = [_exact_bits(arg) for arg in expr.args]
    if expr.is_Pow:  # |b**e| < 2**(bits(b) * |e|) and |e| < 2**bits(e)
        return math.inf if bits[1] > 64 else bits[0] * 2.0 ** bits[1]
    if expr.is_Mul:
        return sum(bits)
    if expr.is_Add:
        return max(bits) + len(bits)
    if type(expr).__name__ in _FAST_GROWING:  # n! has fewer than n * bits(n) bits
        return math.inf if max(bits) > 64 else 2.0 ** max(bits) * max(bits)
    return max(bits)


def math_score(response_text: str, truth: str) -> Score:
    """Reward 1.0 when the response's final answer (``extract_final_answer``) equals ``truth``, else 0.0."""
    answer = extract_final_answer(response_text)
    correct = answer is not None and answers_equal(answer, truth)
    return Score(reward=1.0 if correct else 0.0, correct=correct)


class _DeadlineExceeded(BaseException):
    """Raised in the checking thread by the watchdog; a BaseException, so ``except Exception`` misses it."""


def _call_with_deadline(fn: Callable[[], _T], seconds: float, default: _T) -> _T:
    """``fn()``, or ``default`` if it runs longer than ``seconds``; usable from any thread.

    A watchdog thread raises ``_DeadlineExceeded`` in the calling thread at the
    deadline and again every 50 ms until ``fn`` gives up (in case library code
    swallows it). A pending exception that was not delivered before ``fn``
    returned is cleared, so it cannot surface later in the caller.
    """
    thread_id = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    finished = threading.Event()
    fired = False

    def watchdog() -> None:
        nonlocal fired
        if finished.wait(seconds):
            return
        while True:
            with lock:
                if finished.is_set():
                    return
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, ctypes.py_object(_DeadlineExceeded))
                fired = True
            if finished.wait(0.05):
                return

    try:
        try:
            threading.Thread(target=watchdog, name="math-verify-deadline", daemon=True).start()
            return fn()
        finally:
            while True:  # the watchdog must be stopped even if it strikes right here
                try:
                    with lock:
                        finished.set()
                        if fired:
                            ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, None)
                    break
                except _DeadlineExceeded:
                    continue
    except _DeadlineExceeded:
        return default
