"""The tiny policy: a loadable Hugging Face directory, built once and then served from the cache."""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reflow.config.schema import EnvConfig, ModelConfig, TinyModelConfig
from reflow.envs.arith import ArithEnv
from reflow.envs.tool_calc import ToolCalcEnv
from reflow.policies import tiny as tiny_module
from reflow.policies.tiny import (
    IGNORE_INDEX,
    ensure_tiny_model,
    lr_factor,
    noisy_reference,
    sft_batches,
    tiny_model_key,
)
from reflow.policies.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, build_tokenizer

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                        max_position_embeddings=256, sft_steps=3, sft_examples_per_step=4,
                        sft_answer_noise=0.2)


def _model_cfg(tmp_path: Path) -> ModelConfig:
    return ModelConfig(cache_dir=str(tmp_path / "models"), tiny=SMALL)


def test_build_writes_a_loadable_hf_directory(tmp_path: Path) -> None:
    messages: list[str] = []
    path = ensure_tiny_model(_model_cfg(tmp_path), EnvConfig(), seed=0, progress=messages.append)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == VOCAB_SIZE
    assert config["eos_token_id"] == EOS_ID and config["pad_token_id"] == PAD_ID
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_ID and "top_k" not in generation
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("1+2=")])).logits
    assert logits.shape == (1, 4, VOCAB_SIZE)
    assert any("sft step 3/3" in m for m in messages)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging directory left


def test_second_call_hits_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ensure_tiny_model(_model_cfg(tmp_path), EnvConfig(), seed=0, progress=lambda _: None)

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_module, "build_tiny_model", must_not_build)
    assert ensure_tiny_model(_model_cfg(tmp_path), EnvConfig(), seed=0, progress=lambda _: None) == first


def test_interrupted_build_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(model: object, out_dir: Path) -> None:
        (out_dir / "config.json").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_module, "save_model_dir", fail)
    with pytest.raises(KeyboardInterrupt):
        ensure_tiny_model(_model_cfg(tmp_path), EnvConfig(), seed=0, progress=lambda _: None)
    assert list((tmp_path / "models").iterdir()) == []


def test_cache_key_covers_every_input() -> None:
    base = tiny_model_key(SMALL, EnvConfig(), 0)
    assert tiny_model_key(SMALL, EnvConfig(), 0) == base
    assert tiny_model_key(SMALL, EnvConfig(), 1) != base
    assert tiny_model_key(SMALL, EnvConfig(max_operand=30), 0) != base
    assert tiny_model_key(SMALL.model_copy(update={"sft_steps": 4}), EnvConfig(), 0) != base


def test_sft_batches_train_on_response_and_eos_only() -> None:
    env = ArithEnv(EnvConfig(), seed=0)
    batches = list(sft_batches(env, SMALL.model_copy(update={"sft_answer_noise": 0.0})))
    assert len(batches) == SMALL.sft_steps
    equals_id = build_tokenizer().convert_tokens_to_ids("=")
    for input_ids, labels in batches:
        assert input_ids.shape == labels.shape and input_ids.shape[0] == SMALL.sft_examples_per_step
        for row_ids, row_labels in zip(input_ids.tolist(), labels.tolist()):
            trained = [i for i, label in enumerate(row_labels) if label != IGNORE_INDEX]
            assert trained == list(range(trained[0], trained[-1] + 1))  # one contiguous response span
            assert [row_labels[i] for i in trained] == [row_ids[i] for i in trained]
            assert row_ids[trained[0] - 1] == equals_id  # the prompt ends with "=" and is not trained on
            assert row_ids[trained[-1]] == EOS_ID
            assert all(token == PAD_ID for token in row_ids[trained[-1] + 1:])


def test_sft_batches_do_not_train_on_tool_output() -> None:
    env = ToolCalcEnv(EnvConfig(kind="tool_calc", max_operand=9999), seed=0)
    tok = build_tokenizer()
    rows = 0
    for input_ids, labels in sft_batches(env, SMALL.model_copy(update={"sft_steps": 8})):
        for row_ids, row_labels in zip(input_ids.tolist(), labels.tolist()):
            text = tok.decode(row_ids, skip_special_tokens=True)
            if "<code>" not in text:
                continue
            rows += 1
            trained = tok.decode([t for t, label in zip(row_ids, row_labels) if label != IGNORE_INDEX],
                                 skip_special_tokens=True)
            code = text[text.index("<code>"): text.index("</code>") + len("</code>")]
            answer = text[text.rindex("#"):]
            assert trained == code + answer  # the code block and the answer line, not the output between
    assert rows > 0


def test_noisy_reference_moves_only_the_answer() -> None:
    rng = random.Random(0)
    reference = "12+7=19\n19+30=49\n#49"
    assert noisy_reference(reference, 0.0, rng) == reference
    noisy = [noisy_reference(reference, 0.4, rng) for _ in range(500)]
    changed = [n for n in noisy if n != reference]
    assert 0.3 < len(changed) / len(noisy) < 0.5
    for n in changed:
        steps, _, answer = n.rpartition("#")
        assert steps == "12+7=19\n19+30=49\n" and 1 <= abs(int(answer) - 49) <= 3


def test_lr_schedule_warms_up_then_decays() -> None:
    factors = [lr_factor(step, 100) for step in range(100)]
    assert factors[0] < factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[5:], factors[6:]))
    assert factors[-1] == pytest.approx(0.1, abs=0.01)


def test_arith_cache_keys_ignore_the_fields_of_other_workloads() -> None:
    from reflow.config.load import load_config

    repo = Path(__file__).resolve().parents[2]
    # the keys of the shipped arith configs before the math/code fields existed (tiny-v3)
    for name, key in (("default", "6e1a96d0d8d7c8a9"), ("smoke", "e3e30d682b9594c4")):
        cfg = load_config(repo / f"configs/{name}.toml")
        assert tiny_model_key(cfg.model.tiny, cfg.env, cfg.run.seed) == key
    base = tiny_model_key(SMALL, EnvConfig(), 0)
    assert tiny_model_key(SMALL, EnvConfig(code_memory_mb=512, max_prompt_tokens=99), 0) == base
    assert tiny_model_key(SMALL, EnvConfig(kind="math"), 0) != base
    assert tiny_model_key(SMALL, EnvConfig(kind="math"), 0) != tiny_model_key(SMALL, EnvConfig(kind="code"), 0)


def test_cache_key_follows_the_warm_start_data(monkeypatch: pytest.MonkeyPatch) -> None:
    from reflow.envs import code_env

    code = EnvConfig(kind="code")
    before = tiny_model_key(SMALL, code, 0)
    monkeypatch.setattr(code_env, "INSTRUCTION", "Answer in Python.")  # same configs, other prompts
    assert tiny_model_key(SMALL, code, 0) != before
    monkeypatch.undo()
    assert tiny_model_key(SMALL, code, 0) == before


def test_noisy_reference_uses_the_env_hook() -> None:
    from reflow.envs.math_env import MathEnv

    rng = random.Random(0)
    reference = "7+5=12\n\\boxed{12}"
    noisy = [noisy_reference(reference, 0.4, rng, MathEnv.corrupt_reference) for _ in range(500)]
    changed = [n for n in noisy if n != reference]
    assert 0.3 < len(changed) / len(noisy) < 0.5
    for n in changed:
        body, _, boxed = n.partition("\\boxed{")
        assert body == "7+5=12\n" and 1 <= abs(int(boxed.rstrip("}")) - 12) <= 3
