"""Records that cross a process or storage boundary, defined once.

Alignment rules (checked in ``Trajectory.__post_init__``):

* ``behaviour_logprobs``, ``token_versions`` and ``loss_mask`` have exactly one
  entry per response token;
* ``policy_version`` is the *oldest* entry of ``token_versions`` (a partial
  rollout may span versions), so staleness is ``trainer_version - policy_version``;
* ``loss_mask`` is 1 for tokens the policy generated and 0 for tokens it did
  not (tool output), which are never trained on.

The Arrow schemas are derived from the dataclass fields, so the table and the
record cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
import typing
from dataclasses import dataclass, field

import pyarrow as pa

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Trajectory:
    """One generated response to one prompt, scored."""

    trajectory_id: str
    run_id: str
    prompt_id: str
    group_id: str  # the GRPO group: all samples of one prompt in one round
    sample_index: int
    env: str
    rollout_step: int  # trainer step whose rollout produced it
    policy_version: int  # oldest version among token_versions; partition column
    prompt_tokens: list[int]
    response_tokens: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    loss_mask: list[int]
    reward: float
    correct: bool
    finish_reason: str
    response_length: int
    created_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))

    def __post_init__(self) -> None:
        n = len(self.response_tokens)
        for name in ("behaviour_logprobs", "token_versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.trajectory_id}: {name} has "
                                 f"{len(getattr(self, name))} entries for {n} response tokens")
        if self.response_length != n:
            raise ValueError(f"trajectory {self.trajectory_id}: response_length {self.response_length} != {n}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"trajectory {self.trajectory_id}: finish_reason {self.finish_reason!r} "
                             f"not in {FINISH_REASONS}")
        if self.token_versions and min(self.token_versions) != self.policy_version:
            raise ValueError(f"trajectory {self.trajectory_id}: policy_version {self.policy_version} "
                             f"is not the oldest token version {min(self.token_versions)}")


@dataclass(frozen=True)
class Usage:
    """One use of one trajectory in one trainer step (the consumption log)."""

    run_id: str
    trajectory_id: str
    trainer_step: int
    trainer_version: int  # version of the weights the gradient was computed on
    loss_weight: float
    staleness: int  # trainer_version - trajectory.policy_version
    created_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))


CACHE_STATES = ("marker", "finished", "partial", "pending")


@dataclass(frozen=True)
class CachedSample:
    """One entry of the length-aware scheduler's rollout cache, as of the end of one round.

    Each round appends a snapshot: one ``marker`` row (``group_index`` -1)
    that records the round and ``next_group`` even when the cache is empty,
    then per cached group its ``finished`` and ``partial`` samples (tokens,
    per-token log-probs and versions, aligned as in ``Trajectory``) or one
    ``pending`` row (``sample_index`` -1) for a group with nothing kept.
    The latest round's snapshot is the cache.
    """

    run_id: str
    round: int  # the trainer step whose round left this state
    next_group: int  # first prompt position never loaded
    group_index: int
    sample_index: int
    aborts: int
    state: str
    request_id: str
    response_tokens: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    submitted_version: int
    created_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))

    def __post_init__(self) -> None:
        n = len(self.response_tokens)
        if len(self.behaviour_logprobs) != n or len(self.token_versions) != n:
            raise ValueError(f"cache row {self.request_id or self.group_index}: tokens, log-probs and versions "
                             "differ in length")
        if self.state not in CACHE_STATES:
            raise ValueError(f"cache row state {self.state!r} not in {CACHE_STATES}")


_SCALARS: dict[object, pa.DataType] = {
    str: pa.string(),
    int: pa.int64(),
    float: pa.float64(),
    bool: pa.bool_(),
    dt.datetime: pa.timestamp("us", tz="UTC"),
}
_LISTS: dict[str, pa.DataType] = {
    "prompt_tokens": pa.list_(pa.int32()),
    "response_tokens": pa.list_(pa.int32()),
    "behaviour_logprobs": pa.list_(pa.float32()),
    "token_versions": pa.list_(pa.int32()),
    "loss_mask": pa.list_(pa.int8()),
}


def arrow_schema(record_type: type) -> pa.Schema:
    """Arrow schema derived from a record dataclass (all fields non-null)."""
    hints = typing.get_type_hints(record_type)
    fields = []
    for f in dataclasses.fields(record_type):
        if f.name in _LISTS:
            arrow_type = _LISTS[f.name]
        else:
            hint = hints[f.name]
            if isinstance(hint, types.UnionType):
                raise TypeError(f"{record_type.__name__}.{f.name}: optional fields are not allowed")
            arrow_type = _SCALARS[hint]
        fields.append(pa.field(f.name, arrow_type, nullable=False))
    return pa.schema(fields)


TRAJECTORY_SCHEMA = arrow_schema(Trajectory)
USAGE_SCHEMA = arrow_schema(Usage)
CACHE_SCHEMA = arrow_schema(CachedSample)


def to_table(records: typing.Sequence[object], schema: pa.Schema) -> pa.Table:
    """Records (dataclass instances) to an Arrow table of ``schema``."""
    columns = {name: [getattr(r, name) for r in records] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)


def trajectories_from_table(table: pa.Table) -> list[Trajectory]:
    """Arrow rows back to records (validating alignment)."""
    rows = table.select(TRAJECTORY_SCHEMA.names).to_pylist()
    return [Trajectory(**row) for row in rows]
