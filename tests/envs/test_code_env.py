"""The code workload: APPS loaders on the committed fixtures, program extraction, sandboxed batch scoring."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from reflow.config.schema import EnvConfig
from reflow.envs.base import make_env
from reflow.envs.code_env import INSTRUCTION, CodeEnv, extract_program
from reflow.envs.datasets import DatasetError

FIXTURES = Path(__file__).resolve().parents[2] / "envs" / "fixtures"


def _env(**fields: object) -> CodeEnv:
    env = make_env(EnvConfig(kind="code", **fields), seed=5)  # type: ignore[arg-type]
    assert isinstance(env, CodeEnv)
    return env


def test_extract_program_takes_the_last_fenced_block_else_the_text() -> None:
    assert extract_program("Here:\n```python\nprint(1)\n```\nDone.") == "print(1)\n"
    assert extract_program("```\na=1\n```\nthen\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"
    assert extract_program("```python\nx=1\n```\n```python\nprint(x") == "print(x"  # truncated: to the end


def test_synthetic_references_pass_and_corrupted_ones_fail_in_order() -> None:
    env = _env(code_score_tasks=3)
    prompts = env.prompts("train", 0, 8)
    assert prompts == _env().prompts("train", 0, 8)
    kinds = {json.loads(p.answer)["fn_name"] for p in prompts}
    assert kinds == {None, "f"}  # both stdin and call problems
    refs = [env.reference_solution(p) for p in prompts]
    for prompt, ref in zip(prompts, refs):  # the expression ends the prompt: a short copy into the program
        match = re.search(r"(?:print\((.*)\)|return (.*))\n```$", ref)
        assert match is not None, ref
        assert prompt.text.endswith(f" {match.group(1) or match.group(2)}.\n"), (prompt.text, ref)
    rng = random.Random(0)
    texts = [r if i % 2 == 0 else CodeEnv.corrupt_reference(r, rng) for i, r in enumerate(refs)]
    scores = env.score_many(prompts, texts)
    for i, s in enumerate(scores):  # the strided fan-out puts each score back at its response
        if i % 2 == 0:
            assert s.correct and s.reward == 1.0, (i, texts[i])
        else:
            assert not s.correct and s.reward < 1.0, (i, texts[i])
    assert env.score(prompts[0], "no code at all").reward == 0.0
    evals = {p.text for p in env.prompts("eval", 0, 30)}
    assert not evals & {p.text for p in env.prompts("train", 0, 300)}


def test_partial_credit_is_the_share_of_tests_passed(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    spec = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["1\n", "4\n", "9\n", "17\n"]}
    path.write_text(json.dumps({"question": "square n", "input_output": json.dumps(spec)}) + "\n")
    env = _env(data_path=str(path), eval_holdout_share=0.0)
    (prompt,) = env.prompts("train", 0, 1)
    score = env.score(prompt, "```python\nn=int(input())\nprint(n*n)\n```")
    assert score.reward == pytest.approx(0.75) and not score.correct
    assert _env(data_path=str(path), eval_holdout_share=0.0, code_max_tests=3).score(
        prompt, "```python\nn=int(input())\nprint(n*n)\n```").correct


def test_jsonl_and_parquet_fixtures_load_the_same_problems() -> None:
    rows = [json.loads(line) for line in (FIXTURES / "code_apps.jsonl").read_text().splitlines()]
    assert rows == pq.read_table(FIXTURES / "code_apps.parquet").to_pylist()
    for name in ("code_apps.jsonl", "code_apps.parquet"):
        env = _env(data_path=str(FIXTURES / name), eval_holdout_share=0.0)
        prompts = env.prompts("train", 0, 12)
        assert all(p.text.startswith(INSTRUCTION + "\n\n") for p in prompts)
        questions = [p.text.split("\n")[2] for p in prompts]  # instruction, blank line, question
        assert set(questions) == {r["question"] for r in rows}
        assert any("Starter code:\ndef f(n):" in p.text for p in prompts)
        programs = {r["question"]: json.loads(r["solutions"])[0] for r in rows}
        texts = [f"```python\n{programs[q]}\n```" for q in questions]
        assert all(s.correct for s in env.score_many(prompts, texts))
        assert all(s.correct for s in env.score_many(prompts, [env.reference_solution(p) for p in prompts]))


def test_apps_starter_code_and_line_list_outputs(tmp_path: Path) -> None:
    path = tmp_path / "apps.jsonl"
    spec = {"inputs": [["1 2", "3 4"]], "outputs": [["3", "7"]]}
    row = {"question": "Sum each line.", "input_output": json.dumps(spec), "starter_code": "import sys"}
    path.write_text(json.dumps(row) + "\n")
    env = _env(data_path=str(path), eval_holdout_share=0.0)
    (prompt,) = env.prompts("train", 0, 1)
    assert prompt.text == f"{INSTRUCTION}\n\nSum each line.\n\nStarter code:\nimport sys\n"
    with pytest.raises(ValueError, match="no reference solution"):  # no 'solutions' column
        env.reference_solution(prompt)
    program = "import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)"
    assert env.score(prompt, program).correct


def test_bad_inputs_name_file_row_and_column(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        _env(data_path=str(tmp_path / "missing.jsonl"))
    malformed = tmp_path / "malformed.jsonl"
    good = {"question": "q", "input_output": json.dumps({"inputs": ["1"], "outputs": ["1"]})}
    malformed.write_text(json.dumps(good) + "\n" + json.dumps({"question": "q", "input_output": "{inputs: ["}) + "\n")
    with pytest.raises(DatasetError, match=r"row 1: column 'input_output' is not valid JSON"):
        _env(data_path=str(malformed))
    uneven = tmp_path / "uneven.jsonl"
    uneven.write_text(json.dumps({"question": "q", "input_output": json.dumps({"inputs": ["1", "2"],
                                                                               "outputs": ["1"]})}) + "\n")
    with pytest.raises(DatasetError, match="as many outputs as inputs"):
        _env(data_path=str(uneven))
    no_io = tmp_path / "no_io.jsonl"
    no_io.write_text(json.dumps({"question": "q", "solutions": "[]"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 0: missing column 'input_output'"):
        _env(data_path=str(no_io))
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("nope")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        _env(data_path=str(not_parquet))
