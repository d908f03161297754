"""The tool_calc workload: products solved with a code tool call."""

from __future__ import annotations

import pytest

from reflow.config.schema import EnvConfig
from reflow.envs.base import make_env
from reflow.envs.tool_calc import DIRECT_SHARE, ToolCalcEnv
from reflow.envs.tools import output_spans, run_tool_call


@pytest.fixture
def env() -> ToolCalcEnv:
    return ToolCalcEnv(EnvConfig(kind="tool_calc", max_operand=9999, format_reward=0.1), seed=0)


def test_prompts_are_products_of_large_numbers_and_deterministic(env: ToolCalcEnv) -> None:
    assert make_env(EnvConfig(kind="tool_calc", max_operand=999), seed=0).name == "tool_calc"
    prompts = env.prompts("train", 0, 200)
    assert prompts == env.prompts("train", 0, 200) and env.prompts("train", 50, 5) == prompts[50:55]
    for p in prompts:
        a, b = p.text.removesuffix("=").split("*")
        assert 100 <= int(a) <= 9999 and 100 <= int(b) <= 9999 and p.answer == str(int(a) * int(b))
    evals = {p.text for p in env.prompts("eval", 0, 100)}
    assert not evals & {p.text for p in prompts}


def test_reference_calls_the_tool_except_a_direct_share(env: ToolCalcEnv) -> None:
    prompts = env.prompts("train", 0, 400)
    refs = [env.reference_solution(p) for p in prompts]
    direct = [r for r in refs if "<code>" not in r]
    assert abs(len(direct) / len(refs) - DIRECT_SHARE) < 0.06
    for p, ref in zip(prompts, refs):  # every reference that calls the tool scores, no direct one does
        assert env.score(p, ref).correct == ("<code>" in ref)
    p, ref = next((p, ref) for p, ref in zip(prompts, refs) if "<code>" in ref)
    code_end = ref.index("</code>") + len("</code>")  # the reference's output is exactly what the sandbox appends
    assert ref[code_end:].startswith(run_tool_call(p.text + ref[:code_end], 2.0, 64))
    assert len(output_spans(ref)) == 1


def test_score(env: ToolCalcEnv) -> None:
    (p,) = env.prompts("train", 0, 1)
    assert env.score(p, f"<code>x</code>\n<output>1</output>\n#{p.answer}").reward == 1.0
    assert env.score(p, "#12").reward == pytest.approx(0.1)
    assert env.score(p, f"#{p.answer}\nmore").reward == 0.0
    assert env.score(p, "#").reward == 0.0


def test_small_operands_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_operand"):
        ToolCalcEnv(EnvConfig(kind="tool_calc", max_operand=50), seed=0)
