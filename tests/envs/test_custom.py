"""The custom workload: a reward function named in the config, over the user's rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reflow.config.load import ConfigError, load_config
from reflow.config.schema import EnvConfig
from reflow.envs.base import Prompt, Score, env_class, make_env
from reflow.envs.custom import CustomEnv, RewardFunctionError, load_reward_function, to_score

REWARD = '''
import re

def exact_answer(prompt, response, answer):
    numbers = re.findall(r"-?\\d+", response)
    return 1.0 if numbers and numbers[-1] == answer else 0.0

def batched(prompts, responses, answers):
    return [(0.5, r == a) for r, a in zip(responses, answers)]

def broken(prompt, response, answer):
    return "yes"
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD)
    return path


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    rows.append({"prompt": [{"role": "user", "content": "2*3="}], "answer": 6})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(data: Path, reward: str, **extra) -> EnvConfig:
    return EnvConfig(kind="custom", data_path=str(data), reward_function=reward, eval_holdout_share=0.1, **extra)


def test_a_reward_from_a_file_scores_each_response(reward_file: Path, data_file: Path) -> None:
    env = make_env(_cfg(data_file, f"{reward_file}:exact_answer"), seed=0)
    assert isinstance(env, CustomEnv) and env_class("custom") is CustomEnv
    prompts = env.prompts("train", 0, 3)
    assert all(p.env == "custom" for p in prompts)
    right = [f"so it is {p.answer}" for p in prompts]
    assert env.score_many(prompts, right) == [Score(1.0, True)] * 3
    assert env.score(prompts[0], "no idea") == Score(0.0, False)


def test_a_batched_reward_is_called_once_with_lists(reward_file: Path, data_file: Path) -> None:
    env = make_env(_cfg(data_file, f"{reward_file}:batched", reward_batched=True), seed=0)
    prompts = env.prompts("train", 0, 2)
    calls, reward = [], env.reward
    env.reward = lambda *args: (calls.append(args), reward(*args))[1]
    assert env.score_many(prompts, [prompts[0].answer, "x"]) == [Score(0.5, True), Score(0.5, False)]
    assert calls == [([p.text for p in prompts], [prompts[0].answer, "x"], [p.answer for p in prompts])]


def test_a_reward_from_an_importable_module(reward_file: Path, data_file: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(reward_file.parent))
    sys.modules.pop("my_reward", None)
    assert load_reward_function("my_reward:exact_answer")("p", "it is 7", "7") == 1.0


def test_values_become_scores() -> None:
    assert to_score(1, "f") == Score(1.0, True) and to_score(0.25, "f") == Score(0.25, False)
    assert to_score(True, "f") == Score(1.0, True) and to_score((0.5, True), "f") == Score(0.5, True)
    with pytest.raises(RewardFunctionError, match="returned str 'yes'"):
        to_score("yes", "f")


def test_bad_reward_functions_are_named(reward_file: Path, data_file: Path, tmp_path: Path) -> None:
    cases = [("nocolon", "expected 'module:function'"), (f"{tmp_path}/none.py:f", "no file"),
             (f"{reward_file}:missing", "has no function 'missing'"), ("no_such_module_xyz:f", "importing")]
    for spec, message in cases:
        with pytest.raises(RewardFunctionError, match=message):
            load_reward_function(spec)
    env = make_env(_cfg(data_file, f"{reward_file}:broken"), seed=0)
    with pytest.raises(RewardFunctionError, match="broken: returned str"):
        env.score(env.prompts("train", 0, 1)[0], "x")


def test_rows_and_config_are_checked(data_file: Path, reward_file: Path, tmp_path: Path) -> None:
    assert CustomEnv.parse_row({"question": "1+1=", "answer": 2}, "r").answer == "2"
    assert CustomEnv.parse_row({"prompt": "hi"}, "r").answer == ""
    from reflow.envs.datasets import DatasetError

    with pytest.raises(DatasetError, match="missing column 'prompt'"):
        CustomEnv.parse_row({"text": "hi"}, "rows.jsonl row 3")
    with pytest.raises(ConfigError, match="needs env.reward_function"):
        load_config(None, ['env.kind="custom"', f'env.data_path="{data_file}"', 'model.path="/m"'])
    with pytest.raises(ConfigError, match="applies to env.kind = 'custom'"):
        load_config(None, [f'env.reward_function="{reward_file}:exact_answer"'])
    cfg = load_config(None, ['env.kind="custom"', f'env.data_path="{data_file}"', 'model.path="/m"',
                             f'env.reward_function="{reward_file}:exact_answer"'])
    assert cfg.env.kind == "custom"


def test_prompt_ids_address_the_rows(reward_file: Path, data_file: Path) -> None:
    env = make_env(_cfg(data_file, f"{reward_file}:exact_answer"), seed=0)
    a, b = env.prompts("train", 5, 2), env.prompts("train", 5, 2)
    assert a == b and isinstance(a[0], Prompt)
    assert [p.prompt_id for p in a] == ["custom-train-s0-000005", "custom-train-s0-000006"]
    assert env.prompts("train", 6, 1) == a[1:]  # an id names one row, whatever batch asked for it
    rows = {f"{i}+1=": str(i + 1) for i in range(40)} | {"2*3=": "6"}
    train, held = env.prompts("train", 0, 41), env.prompts("eval", 0, 41)  # each split goes round its rows
    for p in train + held:  # each prompt is a row of the file, with that row's answer
        assert rows[p.text.strip()] == p.answer
    assert {p.text.strip() for p in train + held} == set(rows)  # every row in one split
    assert not {p.text for p in train} & {p.text for p in held}  # and in one only
