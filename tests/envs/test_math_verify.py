"""Math answer checking: boxed extraction, a table of tricky (un)equal pairs, threads, time limits."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from reflow.envs import math_verify
from reflow.envs.base import Score
from reflow.envs.math_verify import _call_with_deadline, answers_equal, extract_boxed, extract_final_answer, math_score

EQUAL = [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\tfrac{1}{2}", "0.5"),
    ("\\frac{3}{6}", "\\frac{1}{2}"),
    ("1,000", "1000"),
    ("1000", "1,000"),
    ("1\\,000", "1000"),
    ("1{,}000", "1000"),
    ("1 000", "1000"),
    ("12,345,678", "12345678"),
    ("\\$5", "5"),
    ("\\$5.00", "5"),
    ("5\\%", "5"),  # policy: the percent sign is optional ...
    ("5\\%", "0.05"),  # ... and a percentage also equals its fraction
    ("\\sqrt{2}/2", "\\frac{\\sqrt 2}{2}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("x=3", "3"),  # policy: an assignment is judged by its value
    ("3", "x=3"),
    ("[1,2)", "[1,2)"),
    ("(-\\infty, 0]", "(-\\infty,0]"),
    ("\\left(1,2\\right)", "(1,2)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("-0", "0"),
    ("3.0", "3"),
    ("1/3", "0.333333"),  # floats agree to 6 decimals
    ("2\\pi", "\\pi \\cdot 2"),
    ("x^2+2x+1", "(x+1)^2"),
    ("10^{3}", "1000"),
    ("90^\\circ", "90"),
    ("5 \\text{ cm}", "5"),
    ("\\text{(A)}", "A"),
    ("\\mathbf{5}", "5"),
    ("3+4i", "4i+3"),
]

UNEQUAL = [
    ("1/3", "0.33"),  # too few decimals
    ("0.3333", "\\frac13"),
    ("2", "3"),
    ("3.5", "3"),
    ("\\pi", "3.14159"),
    ("[1,2)", "(1,2]"),  # intervals keep their brackets
    ("[0,1]", "[0,1)"),
    ("y=3", "x=3"),
    ("-\\infty", "\\infty"),
    ("x^2+1", "(x+1)^2"),
    ("1,2", "12"),  # a comma between single digits is a list, not a separator
    ("B", "A"),
    ("\\text{5 apples}", "5"),
    ("1e3", "1000"),  # policy: no scientific "e" notation (1e3 reads as 1*e*3)
    ("", "1"),
    ("\\frac{1}{0}", "1"),
]


@pytest.mark.parametrize(("predicted", "truth"), EQUAL)
def test_equal_forms(predicted: str, truth: str) -> None:
    assert answers_equal(predicted, truth)


@pytest.mark.parametrize(("predicted", "truth"), UNEQUAL)
def test_unequal_forms(predicted: str, truth: str) -> None:
    assert not answers_equal(predicted, truth)


@pytest.mark.parametrize(("text", "boxed"), [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are literal
    ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last one counts
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$.", "5"),
    ("no box here: 42", None),
    ("\\boxed{}", None),
    ("draft \\boxed{1} final \\boxed{\\frac{2}{3", None),  # truncated last box: no answer
])
def test_extract_boxed(text: str, boxed: str | None) -> None:
    assert extract_boxed(text) == boxed


def test_final_answer_falls_back_to_answer_line() -> None:
    assert extract_final_answer("work...\nAnswer: $\\frac{1}{2}$") == "\\frac{1}{2}"
    assert extract_final_answer("Answer: 3\nmore\nFinal answer: 4") == "4"
    assert extract_final_answer("\\boxed{5}\nAnswer: 4") == "5"  # the box wins
    assert extract_final_answer("I think it is 4.") is None  # no guessing of a last number


def test_math_score() -> None:
    assert math_score("so $x = \\boxed{\\dfrac{1}{2}}$", "0.5") == Score(reward=1.0, correct=True)
    assert math_score("Answer: 1,000", "1000") == Score(reward=1.0, correct=True)
    assert math_score("\\boxed{3}", "4") == Score(reward=0.0, correct=False)
    assert math_score("no answer at all", "4") == Score(reward=0.0, correct=False)


@pytest.mark.parametrize("huge", ["9^{9^{9^{9}}}", "2^{2^{30}}", "(10^{9})!", "100!!",
                                  "\\binom{10^9}{5\\cdot 10^8}"])
def test_huge_numbers_are_refused_before_evaluation(huge: str, monkeypatch) -> None:
    evaluated: list[object] = []
    monkeypatch.setattr(math_verify, "verify", lambda *args, **kwargs: evaluated.append(args) or True)
    assert not answers_equal(huge, "5")
    assert evaluated == []  # refused by its size, not by a deadline that a C call could outlast
    assert answers_equal(huge, huge)  # identical strings need no evaluation


def test_works_in_worker_threads() -> None:
    """Prefect runs tasks in worker threads, where signal-based timeouts raise."""
    pairs = EQUAL[:8] + UNEQUAL[:8]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda pair: answers_equal(*pair), pairs))
    assert results == [True] * 8 + [False] * 8


def test_deadline_interrupts_python_code_in_any_thread() -> None:
    def spin() -> bool:
        while True:
            pass

    # ``spin`` never returns: getting the default back at all is the deadline interrupting it
    assert _call_with_deadline(spin, 0.2, default=False) is False
    box: list[bool] = []
    worker = threading.Thread(target=lambda: box.append(_call_with_deadline(spin, 0.2, default=False)))
    worker.start()
    worker.join(60)
    assert box == [False]


def test_deadline_never_fires_after_returning() -> None:
    for _ in range(300):  # deadlines racing the return
        assert _call_with_deadline(lambda: sum(range(5000)), 0.0002, default=-1) in (sum(range(5000)), -1)
    for _ in range(200_000):  # Python bytecode: a stray pending exception would be delivered in this loop
        pass
