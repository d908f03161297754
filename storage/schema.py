"""Records that cross a process or storage boundary, defined once.

Alignment rules (checked in ``Trajectory.__post_init__``):

* ``behaviour_logprobs``, ``token_versions`` and ``loss_mask`` have exactly one
  entry per response token;
* ``policy_version`` is the *oldest* entry of ``token_versions`` (a partial
  rollout may span versions), so staleness is ``trainer_version - policy_version``;
* ``loss_mask`` is 1 for tokens the policy generated and 0 for tokens it did
  not (tool output), which are never trained on.

The Arrow schemas are derived from the dataclass fields, so the table and the
record cannot drift apart. ``SampleId`` makes and parses every request, group
and trajectory id.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
import typing
from dataclasses import dataclass, field

import pyarrow as pa

FINISH_REASONS = ("stop", "length", "abort")


# --- identity: request, group and trajectory ids -----------------------------------------------------------

@dataclass(frozen=True)
class SampleId:
    """Who a sample is: the round that asked for it, its prompt, its index in the GRPO group.

    ``round_tag`` names the round: ``g<position>`` for a prompt of the train
    stream (streaming modes and SortedRL rounds, ``stream_tag``), ``<step>``
    for a plain round, ``eval<step>`` for an evaluation. The ids built from it
    (a run id never contains ``/``; a prompt id may)::

        request id      <round_tag>/<prompt_id>/<sample>
        group id        <run_id>/<round_tag>/<prompt_id>
        trajectory id   <run_id>/<round_tag>/<prompt_id>/<sample>
    """

    round_tag: str
    prompt_id: str
    sample: int

    @classmethod
    def parse(cls, request_id: str) -> "SampleId":
        """The parts of a request id (ValueError naming it if it has no such shape)."""
        try:
            tag, rest = request_id.split("/", 1)
            prompt_id, sample = rest.rsplit("/", 1)
            return cls(tag, prompt_id, int(sample))
        except ValueError:
            raise ValueError(f"{request_id!r} is not a request id <round>/<prompt id>/<sample>") from None

    @property
    def request_id(self) -> str:
        return f"{self.round_tag}/{self.prompt_id}/{self.sample}"

    def group_id(self, run_id: str) -> str:
        """The GRPO group: every sample of this prompt in this round."""
        return f"{run_id}/{self.round_tag}/{self.prompt_id}"

    def trajectory_id(self, run_id: str) -> str:
        return f"{run_id}/{self.request_id}"

    @property
    def stream_position(self) -> int:
        """``g`` of a ``g<g>`` round tag: the prompt's position in the train stream."""
        return stream_position(self.round_tag)


def stream_tag(position: int) -> str:
    """The round tag of train-stream prompt ``position``."""
    return f"g{position}"


def stream_position(round_tag: str) -> int:
    """The position in a ``g<position>`` round tag (ValueError for another kind of round)."""
    if not round_tag.startswith("g") or not round_tag[1:].isdigit():
        raise ValueError(f"round tag {round_tag!r} is not a train-stream position g<N>")
    return int(round_tag[1:])


def group_stream_position(group_id: str) -> int:
    """The train-stream position of a group id ``<run_id>/g<position>/<prompt_id>``."""
    return stream_position(group_id.split("/", 2)[1])


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


# --- generation: what crosses the engine actor's process boundary ---------------------------------------

@dataclass(frozen=True)
class GenRequest:
    """One sample to generate: a prompt and a token budget.

    A resumed request (a partial rollout from an earlier round) carries what
    was generated so far in ``resume_*`` (aligned, one entry per token); the
    engine continues after them and its result includes them unchanged, so
    every token keeps the log-prob and version it was sampled with.
    ``max_tokens`` counts the resumed tokens too. ``stop``: strings that end
    the sample (finish reason ``stop``) right after the token that completes
    one, which is kept (the multi-turn tool driver stops on ``</code>``).
    """

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    resume_tokens: list[int] = field(default_factory=list)
    resume_logprobs: list[float] = field(default_factory=list)
    resume_versions: list[int] = field(default_factory=list)
    submitted_version: int | None = None  # version when first submitted (None: now)
    stop: tuple[str, ...] = ()
    resume_mask: list[int] | None = None  # of the resumed tokens, 0 where a tool inserted them (None: all 1)

    def __post_init__(self) -> None:
        if not len(self.resume_tokens) == len(self.resume_logprobs) == len(self.resume_versions):
            raise ValueError(f"request {self.request_id}: resume_* lists differ in length")
        if self.resume_mask is not None and len(self.resume_mask) != len(self.resume_tokens):
            raise ValueError(f"request {self.request_id}: resume_mask has {len(self.resume_mask)} entries for "
                             f"{len(self.resume_tokens)} resumed tokens")
        if len(self.resume_tokens) >= self.max_tokens:
            raise ValueError(f"request {self.request_id}: {len(self.resume_tokens)} resumed tokens leave no "
                             f"budget of max_tokens={self.max_tokens}")

    def resumed(self, partial: GenResult) -> GenRequest:
        """This request continued after ``partial``, what an engine had generated for it before an abort: every
        token keeps its log-prob, version and mask."""
        return dataclasses.replace(self, resume_tokens=list(partial.response_tokens),
                                   resume_logprobs=list(partial.logprobs),
                                   resume_versions=list(partial.token_versions),
                                   submitted_version=partial.submitted_version, resume_mask=partial.loss_mask)


@dataclass(frozen=True)
class GenResult:
    """A finished (or aborted) sample; one log-prob and one policy version per response token.

    ``loss_mask`` (one entry per token when set) is 1 for tokens the policy
    sampled and 0 for tokens inserted by a tool; None means every token is the
    policy's (a single-turn engine never inserts any).
    """

    request_id: str
    response_tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    token_versions: list[int]
    submitted_version: int  # engine version when the request was submitted
    loss_mask: list[int] | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_tokens):
            raise ValueError(f"result {self.request_id}: loss_mask has {len(self.loss_mask)} entries for "
                             f"{len(self.response_tokens)} tokens")

    def mask(self) -> list[int]:
        """The loss mask with one entry per response token (all 1 when unset)."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_tokens)

    @property
    def version(self) -> int:
        """The oldest token's policy version (the submit version for an empty response)."""
        return min(self.token_versions, default=self.submitted_version)


@dataclass(frozen=True)
class GenBatch:
    """The results of one ``generate_all`` call and how long the engine spent on it."""

    results: list[GenResult]
    seconds: float
    busy_slot_seconds: float = 0.0  # sum over engine steps of (sequences decoding x step time)
    slots: int = 0  # sequences the engine could have decoded at once in this call


@dataclass(frozen=True)
class Drain:
    """What finished during one drain window of a streaming engine."""

    results: list[GenResult]
    seconds: float  # engine time spent stepping
    in_flight: int  # requests still running
    busy_slot_seconds: float = 0.0  # sum over engine steps of (sequences decoding x step time)
    incarnation: str = ""  # which start of the engine actor answered (a restarted actor lost its requests)
    # requests given back before the window (``EngineWorker.drain(release=True)``): what each had generated,
    # finish reason "abort", to resume on another engine
    released: list[GenResult] = field(default_factory=list)


@dataclass(frozen=True)
class RoundRun:
    """One length-aware round as the engine ran it (``run_round``).

    ``seconds`` is the engine's own clock from receiving the round to having
    aborted what was still running (the span a plain round's
    ``GenBatch.seconds`` covers), so the bubble of both kinds of round is
    measured over the same thing.
    """

    finished: list[GenResult]
    aborted: list[GenResult]  # running when the round ended: tokens so far, finish reason ``abort``
    started: int  # requests taken from the front of the round's queue (the rest never reached the engine)
    seconds: float
    busy_slot_seconds: float  # sum over engine steps of (sequences decoding x step time)
    steps: int  # engine steps taken
    continued: tuple[str, ...] = ()  # queued requests found still running in the engine (parked by the last round)
    # Several engines (``control.sorted_rounds.PooledRoundEngine``): the ids of the requests that reached an
    # engine, which are then not a prefix of the round's queue (``started`` counts them). None: the prefix.
    started_ids: tuple[str, ...] | None = None


# --- Arrow schemas of the storage records --------------------------------------------------------------

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
