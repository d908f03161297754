"""The math workload: DAPO/verl and plain loaders on the committed fixtures, synthetic rows, the reward."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reflow.config.schema import EnvConfig
from reflow.envs.base import make_env
from reflow.envs.datasets import DatasetError, render_messages
from reflow.envs.math_env import MathEnv
from reflow.policies.tokenizer import build_tokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "envs" / "fixtures"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _env(**fields: object) -> MathEnv:
    env = make_env(EnvConfig(kind="math", **fields), seed=3)  # type: ignore[arg-type]
    assert isinstance(env, MathEnv)
    return env


def test_synthetic_prompts_are_deterministic_with_eval_held_out() -> None:
    env = _env()
    train = env.prompts("train", 0, 200)
    assert train == _env().prompts("train", 0, 200) and train[50:60] == env.prompts("train", 50, 10)
    assert train != make_env(EnvConfig(kind="math"), seed=4).prompts("train", 0, 200)
    other_seed_train = {p.text for p in make_env(EnvConfig(kind="math"), seed=4).prompts("train", 0, 400)}
    evals = {p.text for p in env.prompts("eval", 0, 100)}
    assert len(evals) > 90 and not evals & ({p.text for p in train} | other_seed_train)
    assert all(p.text.endswith("Put the final answer in \\boxed{}.\n") and p.text.isascii() for p in train)
    assert len({p.prompt_id for p in train}) == 200


def test_references_are_right_in_an_equivalent_form_and_corrupted_ones_wrong() -> None:
    env = _env()
    prompts = env.prompts("train", 0, 60)
    refs = [env.reference_solution(p) for p in prompts]
    assert all(s.correct and s.reward == 1.0 for s in env.score_many(prompts, refs))
    shares = [(p, r) for p, r in zip(prompts, refs) if "\\frac" in r and "/" in p.answer]
    assert shares, "some fair-share problems have a non-integer answer"
    assert any(r.split("\\frac{")[1].split("}")[0] != p.answer.split("/")[0] for p, r in shares)  # unsimplified
    rng = random.Random(1)
    corrupted = [MathEnv.corrupt_reference(r, rng) for r in refs]
    assert all(c != r for c, r in zip(corrupted, refs))
    assert not any(s.correct for s in env.score_many(prompts, corrupted))


def test_score_accepts_equivalent_forms_and_rejects_others() -> None:
    env = _env(format_reward=0.1)
    (p,) = [q for q in env.prompts("train", 0, 200) if q.answer == "3/2"][:1]
    for text in ("6/4\n\\boxed{\\frac{6}{4}}", "\\boxed{3/2}", "\\boxed{1.5}", "Answer: 3/2"):
        assert env.score(p, text).correct, text
    assert env.score(p, "\\boxed{2}").reward == pytest.approx(0.1)
    assert env.score(p, "3/2").reward == 0.0  # no final answer


def test_dapo_parquet_fixture_loads_with_holdout() -> None:
    env = _env(data_path=str(FIXTURES / "math_dapo.parquet"), eval_holdout_share=0.3)
    rows = pq.read_table(FIXTURES / "math_dapo.parquet").to_pylist()
    by_text = {r["prompt"][0]["content"] + "\n": r["reward_model"]["ground_truth"] for r in rows}
    train, evals = env.prompts("train", 0, 40), env.prompts("eval", 0, 40)
    train_texts, eval_texts = {p.text for p in train}, {p.text for p in evals}
    assert train_texts and eval_texts and not train_texts & eval_texts
    assert train_texts | eval_texts == set(by_text)
    assert all(by_text[p.text] == p.answer for p in train + evals)
    with pytest.raises(ValueError, match="no reference solution"):
        env.reference_solution(train[0])


def test_epochs_cycle_every_row_and_reshuffle() -> None:
    path = str(FIXTURES / "math_dapo.parquet")
    env = _env(data_path=path, eval_data_path=str(FIXTURES / "math_plain.jsonl"))
    stream = [p.text for p in env.prompts("train", 0, 36)]
    epochs = [stream[0:12], stream[12:24], stream[24:36]]
    assert all(len(set(e)) == 12 for e in epochs) and set(epochs[0]) == set(epochs[1]) == set(epochs[2])
    assert epochs[0] != epochs[1]
    assert stream == [p.text for p in _env(data_path=path, eval_data_path=str(FIXTURES / "math_plain.jsonl"))
                      .prompts("train", 0, 36)]
    assert len({p.prompt_id for p in env.prompts("train", 0, 36)}) == 36


def test_plain_jsonl_fixture_and_latex_answers() -> None:
    env = _env(data_path=str(FIXTURES / "math_plain.jsonl"), eval_holdout_share=0.0)
    rows = [json.loads(line) for line in (FIXTURES / "math_plain.jsonl").read_text().splitlines()]
    prompts = env.prompts("train", 0, 12)
    assert {p.text for p in prompts} == {r["question"] + "\n" for r in rows}
    frac = next(p for p in prompts if p.answer.startswith("\\frac"))
    num, den = frac.answer.removeprefix("\\frac{").removesuffix("}").split("}{")
    assert env.score(frac, f"\\boxed{{{int(num) * 2}/{int(den) * 2}}}").correct


def test_chat_template_is_applied_when_the_tokenizer_has_one() -> None:
    tokenizer = build_tokenizer()
    assert not getattr(tokenizer, "chat_template", None)
    plain = make_env(EnvConfig(kind="math", data_path=str(FIXTURES / "math_dapo.parquet"), eval_holdout_share=0),
                     seed=0, tokenizer=tokenizer)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    templated = make_env(EnvConfig(kind="math", data_path=str(FIXTURES / "math_dapo.parquet"),
                                   eval_holdout_share=0), seed=0, tokenizer=tokenizer)
    for p, t in zip(plain.prompts("train", 0, 12), templated.prompts("train", 0, 12)):
        assert t.text == "<|user|>" + p.text + "<|assistant|>"
    assert render_messages((("system", "S"), ("user", "U"))) == "S\n\nU\n"


def test_max_prompt_tokens_drops_long_rows(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"question": "short?", "answer": "1"}) + "\n"
                    + json.dumps({"question": "x" * 500, "answer": "2"}) + "\n")
    env = _env(data_path=str(path), eval_holdout_share=0.0, max_prompt_tokens=100)
    assert {p.answer for p in env.prompts("train", 0, 4)} == {"1"}
    long_only = tmp_path / "long.jsonl"
    long_only.write_text(json.dumps({"question": "x" * 500, "answer": "2"}) + "\n")
    with pytest.raises(DatasetError, match="max_prompt_tokens"):
        _env(data_path=str(long_only), eval_holdout_share=0.0, max_prompt_tokens=100)


def test_bad_inputs_name_file_row_and_column(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        _env(data_path=str(tmp_path / "missing.parquet"))
    no_truth = tmp_path / "no_truth.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "x"}]),
                   no_truth)
    with pytest.raises(DatasetError, match=r"row 0: missing column 'reward_model'"):
        _env(data_path=str(no_truth))
    half = tmp_path / "half.jsonl"
    half.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 1: missing column 'answer'"):
        _env(data_path=str(half))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(DatasetError, match="missing column 'prompt'.*or 'question'"):
        _env(data_path=str(other))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(DatasetError, match="line 2 is not valid JSON"):
        _env(data_path=str(broken))
    bad_messages = tmp_path / "bad_messages.jsonl"
    bad_messages.write_text(json.dumps({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}) + "\n")
    with pytest.raises(DatasetError, match="'prompt' has a message without"):
        _env(data_path=str(bad_messages))


def test_a_dataset_saved_with_save_to_disk_loads_like_its_parquet(tmp_path: Path) -> None:
    """A Hugging Face ``datasets`` directory (Dataset or DatasetDict's train split) gives the parquet's rows."""
    from datasets import Dataset, DatasetDict

    rows = pq.read_table(FIXTURES / "math_dapo.parquet").to_pylist()
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:3])}).save_to_disk(
        str(tmp_path / "dict"))
    expected = _env(data_path=str(FIXTURES / "math_dapo.parquet"), eval_holdout_share=0.3)
    for path in (tmp_path / "one", tmp_path / "dict", tmp_path / "dict" / "train"):
        env = _env(data_path=str(path), eval_holdout_share=0.3)  # data_format "auto" finds the directory's kind
        assert env.prompts("train", 0, 7) == expected.prompts("train", 0, 7), path
        assert env.prompts("eval", 0, 3) == expected.prompts("eval", 0, 3), path
    split = _env(data_path=str(tmp_path / "dict" / "train"), eval_data_path=str(tmp_path / "dict" / "test"))
    assert len({p.text for p in split.prompts("eval", 0, 3)}) == 3
    DatasetDict({"validation": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(DatasetError, match="without a 'train' split \\(has: validation\\)"):
        _env(data_path=str(tmp_path / "no-train")).prompts("train", 0, 1)
    with pytest.raises(DatasetError, match="no such directory"):
        _env(data_path=str(tmp_path / "gone"), data_format="hf_dataset").prompts("train", 0, 1)
