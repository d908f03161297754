"""The arith workload: deterministic streams, held-out eval, exact reward, long-tailed lengths."""

import statistics

import pytest

from reflow.config.schema import EnvConfig
from reflow.envs.arith import ArithEnv, is_eval_text, parse_terms
from reflow.envs.base import Prompt, make_env


@pytest.fixture
def env() -> ArithEnv:
    return ArithEnv(EnvConfig(format_reward=0.1), seed=0)


def _prompt(text: str) -> Prompt:
    return Prompt(prompt_id="t", env="arith", text=text, answer=str(sum(parse_terms(text))))


def test_make_env_returns_arith() -> None:
    assert make_env(EnvConfig(), seed=3).name == "arith"


def test_prompts_are_deterministic_and_index_addressable(env: ArithEnv) -> None:
    whole = env.prompts("train", 0, 50)
    assert whole == ArithEnv(EnvConfig(format_reward=0.1), seed=0).prompts("train", 0, 50)
    assert env.prompts("train", 20, 10) == whole[20:30]
    assert whole[7].prompt_id == "arith-train-s0-000007"


def test_seeds_and_splits_give_different_streams(env: ArithEnv) -> None:
    train = [p.text for p in env.prompts("train", 0, 100)]
    other_seed = [p.text for p in ArithEnv(EnvConfig(), seed=1).prompts("train", 0, 100)]
    evals = [p.text for p in env.prompts("eval", 0, 100)]
    assert train != other_seed
    assert sum(a == b for a, b in zip(train, evals)) < 5


def test_eval_prompts_are_held_out_from_every_train_stream(env: ArithEnv) -> None:
    evals = env.prompts("eval", 0, 200)
    assert all(is_eval_text(p.text) for p in evals)
    for seed in (0, 1):
        train = ArithEnv(EnvConfig(), seed=seed).prompts("train", 0, 2000)
        assert not any(is_eval_text(p.text) for p in train)
    assert {p.text for p in evals}.isdisjoint(p.text for p in env.prompts("train", 0, 2000))


def test_prompt_shape_respects_config() -> None:
    cfg = EnvConfig(min_terms=3, max_terms=5, max_operand=20)
    for p in ArithEnv(cfg, seed=0).prompts("train", 0, 300):
        terms = parse_terms(p.text)
        assert 3 <= len(terms) <= 5
        assert all(1 <= t <= 20 for t in terms)
        assert p.text.endswith("=") and p.answer == str(sum(terms))


def test_reference_solution_format(env: ArithEnv) -> None:
    assert env.reference_solution(_prompt("12+7+30=")) == "12+7=19\n19+30=49\n#49"
    assert env.reference_solution(_prompt("5+6=")) == "5+6=11\n#11"


def test_reference_solutions_score_one(env: ArithEnv) -> None:
    for p in env.prompts("train", 0, 200) + env.prompts("eval", 0, 50):
        assert env.score(p, env.reference_solution(p)).reward == 1.0
        assert env.score(p, env.reference_solution(p)).correct


@pytest.mark.parametrize("response, reward", [
    ("12+7=19\n19+30=49\n#49", 1.0),
    ("#49", 1.0),                      # steps are not checked
    ("12+7=19\n19+30=49\n#49\n", 1.0),  # trailing whitespace is ignored
    ("12+7=19\n19+30=48\n#48", 0.1),   # well formed, wrong: format reward
    ("12+7=19\n19+30=49\n#049", 0.1),  # not canonical
    ("12+7=19\n19+30=49", 0.0),        # no answer line
    ("12+7=19\n19+30=49\n#49 ", 1.0),
    ("12+7=19\n19+30=49\n# 49", 0.0),
    ("12+7=19\n19+30=49\n#49x", 0.0),
    ("12+7=19\n#49\n19+30=49", 0.0),   # text after the answer line
    ("12+7=19\n19+3", 0.0),            # truncated
    ("", 0.0),
])
def test_score_hand_written_cases(env: ArithEnv, response: str, reward: float) -> None:
    score = env.score(_prompt("12+7+30="), response)
    assert score.reward == reward
    assert score.correct == (reward == 1.0)


def test_corrupted_answers_score_zero_with_default_config() -> None:
    env = ArithEnv(EnvConfig(), seed=0)
    for p in env.prompts("train", 0, 50):
        wrong = env.reference_solution(p).rsplit("#", 1)[0] + f"#{int(p.answer) + 1}"
        assert env.score(p, wrong).reward == 0.0


def test_reference_lengths_have_a_long_tail(env: ArithEnv) -> None:
    lengths = sorted(len(env.reference_solution(p)) + 1 for p in env.prompts("train", 0, 2000))  # + <eos>
    p99 = lengths[int(0.99 * len(lengths))]
    assert p99 >= 5 * statistics.median(lengths)


def test_bad_requests_are_rejected(env: ArithEnv) -> None:
    with pytest.raises(ValueError, match="split"):
        env.prompts("test", 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start"):
        env.prompts("train", -1, 1)
    with pytest.raises(ValueError, match="not an arith prompt"):
        parse_terms("hello")
