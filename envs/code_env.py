"""``code``: programming problems scored by running the generated program against tests in a sandbox.

Rows (APPS format; parquet or jsonl; see ``envs/datasets.py`` for splits and
rendering): ``question``; ``input_output``, a JSON string (or object) with
``inputs`` and ``outputs`` lists of equal length and an optional ``fn_name``;
optional ``starter_code``, ``fn_name`` (as a column) and ``solutions`` (a JSON
list of programs; the first one is the reference response).

- standard-input tests (no ``fn_name``): an input is the program's stdin, an
  output its expected stdout (a list of lines is joined with newlines);
  compared up to whitespace;
- call tests (``fn_name``): an input is the list of arguments, an output the
  return value (JSON); the program defines the function or a ``Solution``
  method.

The prompt is one user message: ``INSTRUCTION``, the question, and the starter
code when there is one (instruction first: the problem's own text then ends
the prompt, right before the response that uses it). The program is the last fenced code block of the
response (```` ```python ````, ```` ```py ```` or a bare fence; an unclosed
last fence counts to the end), else the whole response.

Reward: the share of tests passed (the first ``env.code_max_tests``), no
bonus for passing them all; ``correct`` means every test passed. Tests run in
``envs/sandbox.py`` (``run_tests``; limits ``env.code_test_seconds`` and
``env.code_memory_mb``; after a test that times out the rest are skipped,
``env.code_stop_after``). ``score_many`` splits a batch into
``env.code_score_tasks`` chunks run as Ray tasks (``env.code_score_cpus``
each) when Ray is up, else as threads, so a round's programs run in parallel
while the engine keeps generating.

Synthetic dataset (``env.data_path`` unset): "reads an integer n and prints
``n*a+b``" (or ``(n*a+b)%m``) with stdin tests, and "a function f(n) that
returns ..." with call tests (no starter code: the question names the
function); the reference is the two-line program. The expression ends the
question, and each constant follows an operator that occurs once in it
(``*``, ``+``, ``%``), so the program can copy it by looking back for the
same operator (an induction-style copy; written ``a*n+b``, the first
constant followed a space, which the question has many of). The tiny policy
learns the copy late in its warm start: the SFT loss falls from about 0.12
to 0.04 between steps 1,000 and 1,500 of 3,000 (``configs/code.toml``).
"""

from __future__ import annotations

import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from reflow.envs.base import Prompt, Score
from reflow.envs.datasets import DatasetError, Row, RowEnv, require_columns
from reflow.envs.sandbox import SandboxLimits, StopAfter, run_tests

INSTRUCTION = "Answer with Python code in a ```python block."
_FENCED = re.compile(r"```[A-Za-z0-9_+-]*[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[^\n]*\n(.*)\Z", re.DOTALL)
_LAST_INT = re.compile(r"\d+(?!.*\d)", re.DOTALL)

Job = tuple[str, list[tuple[str, str]], "str | None"]  # (program, tests, fn_name)


def extract_program(response_text: str) -> str:
    """The last fenced code block (an unclosed fence after it runs to the end), else the whole response."""
    last, end = None, 0
    for match in _FENCED.finditer(response_text):
        last, end = match.group(1), match.end()
    unclosed = _OPEN_FENCE.search(response_text, end)
    if unclosed is not None:
        return unclosed.group(1)
    return last if last is not None else response_text


def run_jobs(jobs: Sequence[Job], limits: SandboxLimits, stop_after: StopAfter = "timeout") -> list[tuple[int, int]]:
    """``(passed, total)`` for each job, run one after another (the body of a scoring task)."""
    out = []
    for program, tests, fn_name in jobs:
        if not program.strip():
            out.append((0, len(tests)))
            continue
        report = run_tests(program, tests, limits, fn_name=fn_name, stop_after=stop_after)
        out.append((report.passed, report.total))
    return out


class CodeEnv(RowEnv):
    """APPS-style problems with a sandboxed pass-rate reward."""

    name = "code"

    def score(self, prompt: Prompt, response_text: str) -> Score:
        """Share of tests passed; ``correct`` when all pass."""
        return self.score_many([prompt], [response_text])[0]

    def score_many(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> list[Score]:
        """Scores of a batch, its programs run in parallel (Ray tasks when Ray is up, else threads)."""
        if len(prompts) != len(texts):
            raise ValueError(f"score_many: {len(prompts)} prompts but {len(texts)} texts")
        jobs: list[Job] = []
        for prompt, text in zip(prompts, texts):
            spec = json.loads(prompt.answer)
            tests = [tuple(t) for t in spec["tests"][: self.cfg.code_max_tests]]
            jobs.append((extract_program(text), tests, spec["fn_name"]))  # type: ignore[arg-type]
        if not jobs:
            return []
        n_chunks = min(self.cfg.code_score_tasks, len(jobs))
        chunks = [jobs[i::n_chunks] for i in range(n_chunks)]  # strided: long and short programs spread out
        results = self._run_chunks(chunks)
        counts: list[tuple[int, int]] = [(0, 0)] * len(jobs)
        for i, chunk_result in enumerate(results):
            for j, pair in enumerate(chunk_result):
                counts[i + j * n_chunks] = pair
        return [Score(reward=passed / total if total else 0.0, correct=total > 0 and passed == total)
                for passed, total in counts]

    def _limits(self) -> SandboxLimits:
        seconds = self.cfg.code_test_seconds
        return SandboxLimits(cpu_seconds=min(seconds, 10.0), wall_seconds=seconds, memory_mb=self.cfg.code_memory_mb)

    def _run_chunks(self, chunks: list[list[Job]]) -> list[list[tuple[int, int]]]:
        limits, stop = self._limits(), self.cfg.code_stop_after
        ray = sys.modules.get("ray")  # a process that never imported Ray has no cluster to use
        if ray is not None and ray.is_initialized():
            cpus = self.cfg.code_score_cpus
            if ray.available_resources().get("CPU", 0.0) < cpus * len(chunks):
                cpus = 0.0  # the actors hold the CPUs: reserving would queue scoring behind them forever
            task = ray.remote(num_cpus=cpus, max_retries=1)(run_jobs)
            return ray.get([task.remote(chunk, limits, stop) for chunk in chunks])
        with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
            return list(pool.map(lambda chunk: run_jobs(chunk, limits, stop), chunks))

    @staticmethod
    def corrupt_reference(reference: str, rng: random.Random) -> str:
        """The reference with its last number moved by 1..3 (warm-start noise: a near-miss program)."""
        delta = rng.choice((-3, -2, -1, 1, 2, 3))

        def shift(m: re.Match[str]) -> str:
            value = int(m.group(0))
            return str(value + delta if value + delta >= 0 else value - delta)

        return _LAST_INT.sub(shift, reference, count=1)

    @classmethod
    def parse_row(cls, raw: dict[str, Any], where: str) -> Row:
        """An APPS row as a ``Row`` whose answer is ``{"fn_name": ..., "tests": [[input, output], ...]}``."""
        require_columns(raw, ("question", "input_output"), where)
        spec = raw["input_output"]
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: column 'input_output' is not valid JSON ({exc.msg} at char "
                                   f"{exc.pos})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("inputs"), list) \
                or not isinstance(spec.get("outputs"), list):
            raise DatasetError(f"{where}: column 'input_output' must be a JSON object with 'inputs' and "
                               "'outputs' lists")
        inputs, outputs = spec["inputs"], spec["outputs"]
        if not inputs or len(inputs) != len(outputs):
            raise DatasetError(f"{where}: column 'input_output' needs as many outputs as inputs, at least one "
                               f"(got {len(inputs)} inputs, {len(outputs)} outputs)")
        fn_name = spec.get("fn_name") or raw.get("fn_name") or None
        if fn_name is None:
            tests = [[_lines(i), _lines(o)] for i, o in zip(inputs, outputs)]
        else:
            tests = [[json.dumps(i), json.dumps(o)] for i, o in zip(inputs, outputs)]
        answer = json.dumps({"fn_name": fn_name, "tests": tests}, sort_keys=True)
        question = str(raw["question"]).strip()
        starter = str(raw.get("starter_code") or "").strip()
        content = f"{INSTRUCTION}\n\n{question}" + (f"\n\nStarter code:\n{starter}" if starter else "")
        return Row(messages=(("user", content),), answer=answer, reference=_reference(raw.get("solutions"), where),
                   key=json.dumps([question, starter]))  # hold-out by problem text, not its tests

    def synthetic_row(self, rng: random.Random) -> dict[str, Any]:
        """One synthetic problem as an APPS row (see the module docstring)."""
        return synthetic_code_row(rng, self.cfg.max_operand)


def _lines(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _reference(solutions: Any, where: str) -> str | None:
    if solutions is None or solutions == "":
        return None
    if isinstance(solutions, str):
        try:
            solutions = json.loads(solutions)
        except json.JSONDecodeError:
            raise DatasetError(f"{where}: column 'solutions' is not valid JSON") from None
    if not isinstance(solutions, list) or not solutions or not isinstance(solutions[0], str):
        return None
    return f"```python\n{solutions[0].strip()}\n```"


def synthetic_code_row(rng: random.Random, max_operand: int) -> dict[str, Any]:
    """An affine or modular ``f(n)`` to print (stdin tests) or return (call tests), in APPS format."""
    a, b = rng.randint(2, max_operand), rng.randint(0, max_operand)
    modulus = rng.randint(2, 9)
    modulus += int(a % modulus == 0)  # a multiple of the modulus would make f constant
    expr = f"n*{a}+{b}" if rng.random() < 0.5 else f"(n*{a}+{b})%{modulus}"
    ns = rng.sample(range(0, 31), 3)
    values = [eval(expr, {"n": n}) for n in ns]  # noqa: S307 - our own arithmetic expression
    if rng.random() < 0.5:
        question = f"Write a program that reads an integer n and prints {expr}."
        program = f"n=int(input())\nprint({expr})"
        spec: dict[str, Any] = {"inputs": [f"{n}\n" for n in ns], "outputs": [f"{v}\n" for v in values]}
    else:
        question = f"Write a function f(n) that returns {expr}."
        program = f"def f(n):\n    return {expr}"
        spec = {"fn_name": "f", "inputs": [[n] for n in ns], "outputs": values}
    return {"question": question, "input_output": json.dumps(spec), "starter_code": "",
            "solutions": json.dumps([program]), "difficulty": "introductory"}
