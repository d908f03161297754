"""A character-level tokenizer saved as standard Hugging Face files.

One token per character of printable ASCII plus tab, newline and space, and
four special tokens: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3):
101 real tokens. Reserved special tokens ``<reserved_i>`` fill the vocabulary
up to 128 (a multiple of 64, the model's embedding size), so every id a model
can sample is known to the tokenizer: engines never meet an id they cannot
detokenize, and ``skip_special_tokens=True`` drops them. Encoding adds no special tokens (like Qwen's tokenizers,
there is no BOS), so ``encode(prompt) + encode(response)`` equals
``encode(prompt + response)`` and prompt ids are the same whether vLLM or
transformers tokenizes the text; a response ends with ``<eos>``.
``decode(encode(s)) == s`` for every string over the character set.

The directory holds ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` and loads with ``AutoTokenizer.from_pretrained``
and in vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARACTERS: tuple[str, ...] = ("\t", "\n", " ") + tuple(chr(c) for c in range(33, 127))
VOCAB_SIZE = 128  # len(SPECIAL_TOKENS) + len(CHARACTERS) rounded up to a multiple of 64
RESERVED_TOKENS: tuple[str, ...] = tuple(
    f"<reserved_{i}>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARACTERS)))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer as a fast Hugging Face tokenizer (in memory)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS + RESERVED_TOKENS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character is its own pre-token; [\s\S] also matches newlines.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens with nothing in between: exact round trip
    core.add_special_tokens(list(SPECIAL_TOKENS + RESERVED_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN, clean_up_tokenization_spaces=False, model_max_length=1 << 20,
    )


def save_tokenizer(out_dir: Path) -> None:
    """Write the tokenizer files into ``out_dir`` (created if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(out_dir))
    _patch_config_for_older_loaders(out_dir)


def _patch_config_for_older_loaders(out_dir: Path) -> None:
    # transformers 5 names its own backend class and drops special_tokens_map.json;
    # the generic class name and the map keep the directory loadable by transformers 4.x too.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_map = {"pad_token": PAD_TOKEN, "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
                   "unk_token": UNK_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
