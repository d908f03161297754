"""The simulator's cost models: one profile file per kind of cluster, every figure with its source.

A profile (JSON or TOML, ``SimProfile``) says how long the modelled parts of
a run take:

* **engine**: one engine step decodes one token for every running
  sequence and prefills the prompts admitted since the step before:
  ``step_s = step_base_s + per_seq_s * running + per_context_token_s *
  tokens in context + prefill_token_s * prompt tokens admitted``. A weight
  load stops the engine for ``weight_load_s``.
* **trainer**: ``step_base_s + trained tokens * token_s / ranks`` per
  update (on GPUs ``token_s`` is ``6 * parameters / (peak FLOP/s * MFU)``).
* **sync**: a weight push takes ``fixed_s + bytes / bytes_per_s``.
* **driver**: what the control plane spends on the CPU between the roles:
  a buffer append, a selection query, a step's record.
* **machine**: on a CPU machine, more busy actors (engines, the trainer,
  flex workers) than ``cores`` slow each other: each one's compute takes
  ``(busy / cores) ** oversubscription`` times longer. Unset on GPUs.
* **lengths**: response lengths, either the groups of a measured run
  (``groups``: the lengths of each GRPO group's samples, so the spread
  inside a group is kept) or a log-normal fitted to a published p50 and
  p99, cut at ``max``.

Every section carries ``source``: where its figures come from (a command
and date on this machine, or a citation). ``reflow simulate --calibrate``
writes a CPU profile from a ``reflow bench`` output.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reflow.config.load import format_errors


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1, description="where the figures come from")


class EngineCost(_Part):
    step_base_s: float = Field(ge=0)
    per_seq_s: float = Field(ge=0)
    per_context_token_s: float = Field(0.0, ge=0)
    prefill_token_s: float = Field(0.0, ge=0)
    weight_load_s: float = Field(0.0, ge=0)
    slowdown_while_training: float = Field(1.0, ge=1.0, description="engine step time factor while the trainer "
                                           "computes (roles that share cores or memory bandwidth; 1 on GPUs)")
    streaming_slowdown: float = Field(1.0, gt=0.0, description="engine step time factor in the streaming modes, "
                                      "on top: what the loops' own work (appends, queries, weight loads, many "
                                      "short drain calls) takes from an engine that shares the machine, and what "
                                      "the step fitted on sync's rounds misses at the streaming load (below 1 "
                                      "where it overstates that step)")
    streaming_slowdown_by_mode: dict[str, float] = Field(default_factory=dict, description="the same, measured "
                                                         "per mode (overrides streaming_slowdown)")

    def streaming(self, mode: str | None) -> float:
        return self.streaming_slowdown_by_mode.get(mode or "", self.streaming_slowdown)

    def step_s(self, running: int, context_tokens: float, prefill_tokens: float) -> float:
        return (self.step_base_s + self.per_seq_s * running + self.per_context_token_s * context_tokens
                + self.prefill_token_s * prefill_tokens)


class TrainerCost(_Part):
    step_base_s: float = Field(ge=0)
    token_s: float = Field(gt=0, description="seconds per trained (loss) token on one rank")
    overhead_s: float = Field(0.0, ge=0, description="per update call beyond the compute (reading the batch, "
                              "logging its use): on the step's path, not counted as trainer work")
    read_s: float = Field(0.0, ge=0, description="streaming: reading a batch that was not prefetched (selected "
                          "after the step before ended), on the step's path, not counted as trainer work")
    slowdown_while_generating: float = Field(1.0, ge=1.0, description="compute time factor of a step that runs "
                                             "while an engine generates (shared cores; 1 on GPUs)")
    slowdown_by_mode: dict[str, float] = Field(default_factory=dict, description="the same, measured per mode "
                                               "(each mode's other work beside the trainer differs: reads of the "
                                               "next batch, appends, the engine); overrides the one above")

    def slowdown(self, mode: str | None) -> float:
        return self.slowdown_by_mode.get(mode or "", self.slowdown_while_generating)

    def step_s(self, tokens: int, ranks: int) -> float:
        return self.step_base_s + tokens * self.token_s / max(1, ranks)


class SyncCost(_Part):
    fixed_s: float = Field(ge=0)
    bytes: float = Field(ge=0, description="bytes of one full copy of the weights")
    bytes_per_s: float = Field(gt=0)

    def seconds(self) -> float:
        return self.fixed_s + self.bytes / self.bytes_per_s


class DriverCost(_Part):
    write_s: float = Field(0.0, ge=0, description="one append of scored groups (fixed part)")
    write_sample_s: float = Field(0.0, ge=0, description="per sample scored and appended")
    select_s: float = Field(0.0, ge=0, description="one selection query")
    record_s: float = Field(0.0, ge=0, description="a step's record (metrics, weights push call)")
    round_score_s: float = Field(0.0, ge=0, description="rounds: scoring and appending a round, fixed part")
    window_gap_s: float = Field(0.0, ge=0, description="streaming: engine time lost between two drain windows (the "
                                "feeder's call to the engine and its results coming back)")
    round_overhead_s: float = Field(0.0, ge=0, description="rounds: the flow's own time per step beside its timed "
                                    "tasks, before the next round is submitted (task runs, the step's metrics)")
    round_record_s: float = Field(0.0, ge=0, description="rounds: recording a step (tracking, eval snapshots); "
                                  "sync records while the next round runs, one_step_off before submitting it")


class MachineCost(_Part):
    """Actors that share cores: with more busy actors than ``cores``, each one's compute slows down."""

    cores: float | None = Field(None, gt=0, description="cores the modelled actors share (None: each actor has "
                                "its own device, as on a GPU cluster)")
    oversubscription: float = Field(1.0, ge=0, description="with more busy actors than cores, each one's compute "
                                    "time times (busy / cores) ** this (1: the cores are shared evenly; above 1: "
                                    "sharing costs more than its share)")

    def factor(self, busy: int) -> float:
        """Compute time factor with ``busy`` actors computing at once; the engine and trainer factors above were
        measured with at most ``cores`` of them, so up to ``cores`` it is 1."""
        if self.cores is None or busy <= self.cores:
            return 1.0
        return (busy / self.cores) ** self.oversubscription


class MeasuredGroups(BaseModel):
    """Measured groups: response lengths, and the rewards beside them."""

    model_config = ConfigDict(extra="forbid")

    lengths: list[list[int]] = Field(min_length=1)
    rewards: list[list[float]] | None = None
    ordered: bool = Field(False, description="a trace: group g of a simulation is the g-th group here (cycling), "
                          "the run's groups in train-stream order, its samples in order; else a group drawn whole "
                          "at random and its samples shuffled")

    @model_validator(mode="after")
    def _aligned(self) -> MeasuredGroups:
        if any(not g for g in self.lengths):
            raise ValueError("every measured group needs at least one length")
        if self.rewards is not None and [len(g) for g in self.lengths] != [len(r) for r in self.rewards]:
            raise ValueError("rewards: one per measured length, group by group")
        return self

    def draw(self, rng: np.random.Generator, samples: int, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``samples`` lengths and rewards of one group: the ``index``-th if ``ordered``, else a random one."""
        g = index % len(self.lengths) if self.ordered else int(rng.integers(len(self.lengths)))
        order = range(samples) if self.ordered else rng.permutation(samples)
        pick = [i % len(self.lengths[g]) for i in order]
        lengths = np.asarray([self.lengths[g][i] for i in pick], dtype=np.int64)
        if self.rewards is not None:
            return lengths, np.asarray([self.rewards[g][i] for i in pick], dtype=float)
        return lengths, (rng.random(samples) < rng.random()).astype(float)


class Lengths(_Part):
    prompt_tokens: float = Field(gt=0, description="mean prompt tokens per sample")
    groups: list[list[int]] | None = Field(None, description="measured response lengths, one list per group")
    group_rewards: list[list[float]] | None = Field(None, description="the measured groups' rewards, in the "
                                                    "same order (None: each group draws a pass rate)")
    p50: float | None = Field(None, gt=0)
    p99: float | None = Field(None, gt=0)
    max: int | None = Field(None, ge=1)
    within_group_sigma: float = Field(0.3, ge=0, description="log-normal: spread of a sample around its "
                                      "group's length (log scale)")
    by_run: dict[str, MeasuredGroups] = Field(default_factory=dict, description="measured groups of each run, "
                                              "keyed 'mode:seed': a simulated run draws from the run of its mode "
                                              "and seed when present, else from its mode's runs (the policy a "
                                              "mode trains, from a seed, writes responses of its own lengths)")

    @model_validator(mode="after")
    def _one_kind(self) -> Lengths:
        if self.groups is None and (self.p50 is None or self.p99 is None or self.max is None):
            raise ValueError("lengths: give either groups (measured) or p50, p99 and max (log-normal)")
        if self.groups is not None and (not self.groups or any(not g for g in self.groups)):
            raise ValueError("lengths.groups: every group needs at least one length")
        if self.group_rewards is not None and (self.groups is None or [len(g) for g in self.groups]
                                               != [len(r) for r in self.group_rewards]):
            raise ValueError("lengths.group_rewards: one reward per measured length, group by group")
        if self.groups is None and not self.p50 < self.p99 <= self.max:
            raise ValueError(f"lengths: need p50 < p99 <= max, got {self.p50}, {self.p99}, {self.max}")
        return self

    def source_for(self, mode: str | None, seed: int | None) -> MeasuredGroups | None:
        """The measured groups a run of ``mode`` and ``seed`` draws from (None: the log-normal)."""
        if f"{mode}:{seed}" in self.by_run:
            return self.by_run[f"{mode}:{seed}"]
        runs = [g for key, g in sorted(self.by_run.items()) if key.split(":")[0] == mode]
        if runs:
            rewards = None if any(g.rewards is None for g in runs) else [r for g in runs for r in g.rewards]
            return MeasuredGroups(lengths=[n for g in runs for n in g.lengths], rewards=rewards)
        if self.groups is not None:
            return MeasuredGroups(lengths=self.groups, rewards=self.group_rewards)
        return None

    def group(self, rng: np.random.Generator, samples: int, measured: MeasuredGroups | None = None,
              index: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Response lengths and rewards of group ``index`` (its train-stream position) of ``samples``: a group of
        ``measured`` (``MeasuredGroups.draw``), or modelled: log-normal lengths, a uniform pass rate and Bernoulli
        rewards."""
        if measured is not None:
            return measured.draw(rng, samples, index)
        if self.groups is not None:
            return MeasuredGroups(lengths=self.groups, rewards=self.group_rewards).draw(rng, samples)
        # the p50 and p99 of lengths are those of a log-normal whose sigma mixes the group's and the sample's
        total_sigma = (math.log(self.p99) - math.log(self.p50)) / 2.3263
        group_sigma = math.sqrt(max(total_sigma ** 2 - self.within_group_sigma ** 2, 0.0))
        centre = math.log(self.p50) + rng.normal(0.0, group_sigma)
        lengths = np.exp(centre + rng.normal(0.0, self.within_group_sigma, size=samples))
        rewards = (rng.random(samples) < rng.random()).astype(float)
        return np.clip(np.rint(lengths), 1, self.max).astype(np.int64), rewards


class SimProfile(BaseModel):
    """A cluster kind's cost models (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    engine: EngineCost
    trainer: TrainerCost
    sync: SyncCost
    driver: DriverCost
    lengths: Lengths
    machine: MachineCost = Field(default_factory=lambda: MachineCost(
        source="not modelled: every actor has its own device"))
    calibration: dict = Field(default_factory=dict, description="what a calibration measured (for the record)")


def load_profile(path: str | Path) -> SimProfile:
    """A profile from a JSON or TOML file; ValueError naming the file and the field if it is not one."""
    path = Path(path)
    if path.suffix not in (".toml", ".json"):  # the suffix says which parser reads it
        raise ValueError(f"profile {path}: expected a .toml or .json file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"profile {path}: cannot read it ({exc.strerror})") from exc
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({exc})") from exc
    try:
        return SimProfile.model_validate(data)
    except ValidationError as exc:
        raise ValueError(format_errors(exc, f"invalid profile ({path}):")) from None


def save_profile(profile: SimProfile, path: str | Path) -> Path:
    """JSON, one measured group per line."""
    path = Path(path)
    text = re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]",
                  lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]",
                  profile.model_dump_json(indent=1))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
    return path
