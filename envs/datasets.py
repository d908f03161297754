"""Dataset-backed workloads: read parquet/jsonl rows, render chat prompts, address them by index.

``read_rows`` reads a dataset into plain dicts (parquet through pyarrow, jsonl
one JSON object per line, a directory saved by ``datasets``' ``save_to_disk``
through ``datasets.load_from_disk``: a Dataset, or a DatasetDict's ``train``
split). A workload turns each raw row into a ``Row`` (chat
messages, the answer the reward needs, an optional reference solution) and
raises ``DatasetError`` naming the file, the row and the column when a row is
not in the expected format.

``RowEnv`` is the shared ``Env`` of such workloads (``math``, ``code``):

- prompts are the row's chat messages rendered with the tokenizer's chat
  template when it has one (``apply_chat_template(..., add_generation_prompt=
  True, tokenize=False)``), else joined plainly (contents separated by a blank
  line, then a newline);
- rows whose rendered prompt is longer than ``env.max_prompt_tokens`` are
  dropped (tokens of the tokenizer; characters without one);
- eval rows come from ``env.eval_data_path``, or are held out of
  ``env.data_path``: a row is eval exactly when a hash of its content falls
  below ``env.eval_holdout_share`` (seed-independent, so no seed's train
  stream contains an eval row);
- a split's stream cycles through its rows: position ``i`` is row
  ``perm_e[i % n]`` of epoch ``e = i // n``, each epoch a permutation seeded
  by ``(seed, split, e)``. So ``prompts(split, start, count)`` is index-
  addressable and reshuffled every epoch.
- without ``env.data_path`` the workload's synthetic generator supplies raw
  rows in the same file format (row ``i`` of a split from its own seeded RNG,
  eval rows held out by a hash of the problem text), parsed by the same code.
"""

from __future__ import annotations

import functools
import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow.parquet as pq

from reflow.config.schema import EnvConfig, dataset_format
from reflow.envs.base import BatchScoring, Prompt, Split, check_range, stable_hash

EVAL_BUCKETS = 16  # synthetic datasets: 1 in 16 problem texts is reserved for eval
_HOLDOUT_SCALE = 1_000_000
_MAX_DRAWS = 10_000


class DatasetError(ValueError):
    """A dataset file is missing or not in the expected format; the message names file, row and column."""


@dataclass(frozen=True)
class Row:
    """One normalised dataset row.

    ``messages``: chat messages ``(role, content)``; ``answer``: what the reward
    needs (math: the ground truth; code: the tests as canonical JSON);
    ``reference``: an ideal response, when the dataset has one (the synthetic
    datasets do; it is what the tiny policy is warm-started on); ``key``: a
    stable string of the row's content (eval hold-out hashes it).
    """

    messages: tuple[tuple[str, str], ...]
    answer: str
    reference: str | None
    key: str


RowParser = Callable[[dict[str, Any], str], Row]  # (raw row, "file row N" for messages) -> Row


def read_rows(path: str, fmt: str) -> list[dict[str, Any]]:
    """All rows of a parquet or jsonl file, or a saved dataset, as dicts. DatasetError if missing or unreadable."""
    p = Path(path)
    if fmt == "hf_dataset":
        return _saved_dataset_rows(p)
    if not p.is_file():
        raise DatasetError(f"{path}: no such file")
    if fmt == "parquet":
        try:
            return pq.read_table(p).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None
    rows = []
    with open(p, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: line {line_no} is not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: line {line_no} is not a JSON object")
            rows.append(row)
    return rows


def _saved_dataset_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a directory written by ``Dataset.save_to_disk`` (or a DatasetDict's ``train`` split)."""
    if not path.is_dir():
        raise DatasetError(f"{path}: no such directory (a dataset saved with save_to_disk)")
    from datasets import DatasetDict, load_from_disk  # about 1 s: only for this format

    try:
        dataset = load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for a directory it cannot read
        raise DatasetError(f"{path}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise DatasetError(f"{path}: a DatasetDict without a 'train' split (has: {', '.join(dataset)}); point "
                               "env.data_path at one split's directory")
        dataset = dataset["train"]
    return dataset.to_list()


def require_columns(row: dict[str, Any], columns: Sequence[str], where: str) -> None:
    """Raise DatasetError naming the first of ``columns`` missing from ``row``."""
    for column in columns:
        if column not in row or row[column] is None:
            raise DatasetError(f"{where}: missing column {column!r} (has: {', '.join(sorted(row)) or 'none'})")


@functools.lru_cache(maxsize=8)
def _parsed_file(path: str, fmt: str, parser: RowParser) -> tuple[Row, ...]:
    rows = read_rows(path, fmt)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return tuple(parser(raw, f"{path}: row {i}") for i, raw in enumerate(rows))


def load_file(path: str, declared_format: str, parser: RowParser) -> tuple[Row, ...]:
    """Parsed rows of a dataset file (cached per process by path, format and parser)."""
    fmt = dataset_format(path, declared_format)
    if fmt is None:
        raise DatasetError(f"{path}: unknown format (use .parquet or .jsonl, a save_to_disk directory, or set "
                           "env.data_format)")
    return _parsed_file(str(Path(path).resolve()), fmt, parser)


def parse_messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """Chat messages from a ``prompt`` cell: a list of ``{role, content}`` (or its JSON, or a plain string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return (("user", value),)
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: column 'prompt' must be a non-empty list of {{role, content}} messages")
    out = []
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DatasetError(f"{where}: column 'prompt' has a message without string 'role' and 'content': "
                               f"{str(message)[:80]!r}")
        out.append((message["role"], message["content"]))
    return tuple(out)


def render_messages(messages: Sequence[tuple[str, str]], tokenizer: Any = None) -> str:
    """The prompt text: the tokenizer's chat template with a generation prompt, else contents joined plainly."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        chat = [{"role": role, "content": content} for role, content in messages]
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(content for _, content in messages) + "\n"


def prompt_length(text: str, tokenizer: Any = None) -> int:
    """Length of a rendered prompt in the tokenizer's tokens (characters without a tokenizer)."""
    if tokenizer is None:
        return len(text)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def holdout_is_eval(row: Row, share: float) -> bool:
    """Whether a file row belongs to the held-out eval split (a hash of its content, seed-independent)."""
    return stable_hash("reflow-holdout/" + row.key) % _HOLDOUT_SCALE < share * _HOLDOUT_SCALE


class RowEnv(BatchScoring, ABC):
    """``Env`` over dataset rows (a file, or the workload's synthetic generator); see the module docstring.

    Subclasses set ``name``, implement ``parse_row`` (raw dict -> ``Row``),
    ``synthetic_row`` (raw dict of the synthetic dataset) and ``score``.
    """

    name = "rows"

    def __init__(self, cfg: EnvConfig, seed: int, tokenizer: Any = None) -> None:
        self.cfg, self.seed, self.tokenizer = cfg, seed, tokenizer
        self._splits: dict[str, list[Row]] | None = None
        if cfg.data_path is not None:
            self._splits = self._load_splits()
        self._perms: dict[tuple[str, int], list[int]] = {}

    # -- subclass hooks -------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def parse_row(cls, raw: dict[str, Any], where: str) -> Row:
        """One raw row (a dict from the file) as a ``Row``; ``DatasetError`` naming ``where`` if malformed."""

    @abstractmethod
    def synthetic_row(self, rng: random.Random) -> dict[str, Any]:
        """One raw row of the built-in synthetic dataset, drawn from ``rng``."""

    # -- Env ------------------------------------------------------------------------------------------------
    def prompts(self, split: Split, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start+count-1`` of ``split`` (see the module docstring)."""
        check_range(split, start, count)
        out = []
        for i in range(start, start + count):
            row = self._row(split, i)
            out.append(Prompt(prompt_id=f"{self.name}-{split}-s{self.seed}-{i:06d}", env=self.name,
                              text=render_messages(row.messages, self.tokenizer), answer=row.answer))
        return out

    def reference_solution(self, prompt: Prompt) -> str:
        """The row's reference response (synthetic datasets); a ValueError for rows without one."""
        try:
            _, split, _, index = prompt.prompt_id.rsplit("-", 3)
            row = self._row(split, int(index))  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"{self.name}: not a prompt of this env: {prompt.prompt_id!r}") from None
        if row.reference is None:
            raise ValueError(f"{self.name}: row of {prompt.prompt_id!r} has no reference solution (dataset files "
                             "carry none; warm-starting needs the synthetic dataset)")
        return row.reference

    # -- rows -----------------------------------------------------------------------------------------------
    def _row(self, split: Split, index: int) -> Row:
        if self._splits is None:
            return self._synthetic(split, index)
        rows = self._splits[split]
        if not rows:
            raise DatasetError(f"env: the {split} split has no rows (set env.eval_data_path or raise "
                               "env.eval_holdout_share, or set env.eval_prompts = 0)")
        epoch, position = divmod(index, len(rows))
        perm = self._perms.get((split, epoch))
        if perm is None:
            perm = list(range(len(rows)))
            random.Random(stable_hash(f"{self.name}/{split}/{self.seed}/epoch{epoch}")).shuffle(perm)
            self._perms = {k: v for k, v in self._perms.items() if k[0] != split}  # keep one epoch per split
            self._perms[(split, epoch)] = perm
        return rows[perm[position]]

    def _synthetic(self, split: Split, index: int) -> Row:
        rng = random.Random(stable_hash(f"{self.name}-synthetic/{split}/{self.seed}/{index}"))
        want_eval = split == "eval"
        for _ in range(_MAX_DRAWS):
            row = self.parse_row(self.synthetic_row(rng), f"{self.name} synthetic row")
            is_eval = stable_hash(f"{self.name}-eval-partition/" + row.key) % EVAL_BUCKETS == 0
            text = render_messages(row.messages, self.tokenizer)
            if is_eval == want_eval and prompt_length(text, self.tokenizer) <= self.cfg.max_prompt_tokens:
                return row
        raise RuntimeError(f"{self.name}: no synthetic {split} row after {_MAX_DRAWS} draws; raise "
                           "env.max_operand or env.max_prompt_tokens")

    def _load_splits(self) -> dict[str, list[Row]]:
        cfg = self.cfg
        assert cfg.data_path is not None
        rows = self._fits(load_file(cfg.data_path, cfg.data_format, type(self).parse_row), cfg.data_path)
        if cfg.eval_data_path is not None:
            evals = self._fits(load_file(cfg.eval_data_path, cfg.data_format, type(self).parse_row),
                               cfg.eval_data_path)
            return {"train": rows, "eval": evals}
        held = [holdout_is_eval(r, cfg.eval_holdout_share) for r in rows]
        return {"train": [r for r, e in zip(rows, held) if not e], "eval": [r for r, e in zip(rows, held) if e]}

    def _fits(self, rows: Sequence[Row], path: str) -> list[Row]:
        limit = self.cfg.max_prompt_tokens
        kept = [r for r in rows if prompt_length(render_messages(r.messages, self.tokenizer), self.tokenizer) <= limit]
        if not kept:
            raise DatasetError(f"{path}: every row's prompt is longer than env.max_prompt_tokens ({limit})")
        return kept


def check_dataset(cfg: EnvConfig, env_class: type[RowEnv]) -> None:
    """Read and parse the dataset files ``cfg`` names; raises DatasetError. Used before a run starts.

    The prompt-length filter is not applied here (it needs the model's tokenizer).
    """
    for path in (cfg.data_path, cfg.eval_data_path):
        if path is not None:
            load_file(path, cfg.data_format, env_class.parse_row)
