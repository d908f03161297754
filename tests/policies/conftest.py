from __future__ import annotations

from pathlib import Path

import pytest

from reflow.config.schema import EnvConfig, TinyModelConfig


@pytest.fixture()
def env_cfg() -> EnvConfig:
    return EnvConfig(max_terms=6)


# Successor of each character in the bigram model: from ")" it writes "</code>", then <eos>; from "\n" it
# writes "#", then <eos>. So a prompt ending inside a code block ("...<code>print(6*7)") closes the block,
# and after an appended tool output ("...</output>\n") it writes the answer marker.
BIGRAM_CHAIN = {")": "<", "<": "/", "/": "c", "c": "o", "o": "d", "d": "e", "e": ">", ">": "<eos>",
                "\n": "#", "#": "<eos>"}


@pytest.fixture(scope="session")
def bigram_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 model that deterministically follows ``BIGRAM_CHAIN`` (next token = f(current token)).

    Every layer is zeroed (the residual stream is the current token's one-hot embedding), and the untied
    output head maps token t to a logit of about 113 for its successor: sampling at temperature 1 is greedy.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    from reflow.policies.tiny import qwen3_config, save_model_dir
    from reflow.policies.tokenizer import VOCAB_SIZE, build_tokenizer

    tiny = TinyModelConfig(hidden_size=VOCAB_SIZE, num_heads=4, num_kv_heads=1, intermediate_size=64,
                           num_layers=1, sft_steps=0)
    config = qwen3_config(tiny)
    config.tie_word_embeddings = False
    model = Qwen3ForCausalLM(config)
    tok = build_tokenizer()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.zeros_like(param))
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB_SIZE))
        for cur, nxt in BIGRAM_CHAIN.items():
            model.lm_head.weight[tok.convert_tokens_to_ids(nxt), tok.convert_tokens_to_ids(cur)] = 10.0
    out = tmp_path_factory.mktemp("bigram_model")
    save_model_dir(model, out)
    return out
