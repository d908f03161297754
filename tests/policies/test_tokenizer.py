"""The character-level tokenizer: exact round trip, standard files, no implicit special tokens."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reflow.config.schema import EnvConfig
from reflow.envs.arith import ArithEnv
from reflow.policies.tokenizer import BOS_ID, CHARACTERS, EOS_ID, PAD_ID, UNK_ID, VOCAB_SIZE, save_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(out)
    return out


def _workload_strings() -> list[str]:
    env = ArithEnv(EnvConfig(max_operand=999), seed=0)
    prompts = env.prompts("train", 0, 100) + env.prompts("eval", 0, 20)
    texts = [p.text for p in prompts] + [env.reference_solution(p) for p in prompts]
    return texts + ["".join(CHARACTERS), "  two  spaces\n\ttab and \"quotes\", (parens) {braces} ~!@", ""]


def test_files_are_standard(tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tokenizer_dir / name).is_file()
    special = json.loads((tokenizer_dir / "special_tokens_map.json").read_text())
    assert special["eos_token"] == "<eos>" and special["pad_token"] == "<pad>"


def test_auto_tokenizer_loads_with_the_special_ids(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD_ID, BOS_ID, EOS_ID,
                                                                                        UNK_ID)
    assert len(tok) == VOCAB_SIZE == 128
    assert len(CHARACTERS) + 4 < VOCAB_SIZE


def test_round_trip_is_exact(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in _workload_strings():
        ids = tok.encode(text)
        assert len(ids) == len(text)  # one token per character, no special tokens added
        assert tok.decode(ids) == text
        assert tok.decode(ids + [EOS_ID], skip_special_tokens=True) == text


def test_prompt_and_response_concatenate(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt, response = "12+7+30=", "12+7=19\n19+30=49\n#49"
    assert tok.encode(prompt) + tok.encode(response) == tok.encode(prompt + response)


def test_unknown_characters_and_reserved_ids(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.encode("é") == [UNK_ID]
    reserved = list(range(len(CHARACTERS) + 4, VOCAB_SIZE))
    assert tok.decode([tok.encode("7")[0], *reserved], skip_special_tokens=True) == "7"
