"""``reflow simulate --calibrate BENCH_DIR``: a CPU profile fitted to the runs of one ``reflow bench``.

Each figure comes from what the runs logged (``steps.jsonl``) and wrote
(their Delta tables), and the profile names the bench it came from:

* **engine**: from the plain ``sync`` rounds, which run the engine alone
  (the trainer waits). A round of requests that all start at once (its
  batch fits the engine's slots) takes ``L`` decode steps, ``L`` its
  longest response, and decodes ``sum(lengths)`` sequence-steps, over
  contexts that sum to ``sum(prompt * length + length * (length + 1) /
  2)`` tokens. Non-negative least squares of the rounds' engine seconds on
  those three gives ``step_base_s``, ``per_seq_s`` and
  ``per_context_token_s``. The weight load is the rounds' blocking sync
  (median ``sync_weights_seconds``).
* **trainer**: least squares of each step's compute seconds
  (``(1 - trainer_idle_fraction) * step_seconds``) on its trained tokens
  (the loss tokens that went through forward and backward; samples with a
  zero advantage are skipped), over every step of every run; ``overhead_s``
  is the median of ``update_seconds`` minus the compute (reading the
  batch, the usage log, the task run); ``read_s`` the median
  ``trainer_read_seconds`` of the streaming steps whose batch was not
  prefetched (selected after the step before ended: read on the path).
* **sharing the machine**: ``trainer.slowdown_while_generating`` is the
  median of measured over alone-predicted compute in the steps of the
  other modes (the trainer beside an engine); ``engine.slowdown_while_training``
  is ``1 +`` the median of a ``one_step_off`` round's extra seconds over
  the sync-fitted prediction, per second the update ran beside it.
* **driver**: medians of the streaming steps' ``select_seconds``,
  ``write_seconds / writes`` and ``previous_log_seconds``, of the rounds'
  ``score_seconds``; the rounds' flow time beside their timed tasks:
  sync's mean is what every round step spends on its path
  (``round_overhead_s``), and one_step_off's mean beyond it is the
  record (``round_record_s``), which sync hides behind its next round.
* **lengths**: the groups the calibration runs wrote, lengths and rewards
  together (a hard prompt is both long and wrong in every sample, and such
  a group costs generation and no training), pooled and per mode: the
  policy a mode trains writes responses of its own lengths (async's
  averaged 44.2 tokens where sync's averaged 37.9, seed 0, 2026-12-05),
  and a simulator cannot learn, so each mode draws from its own runs.
* **traces** (``bench_traces``): every group each run wrote, and every
  group a streaming run gave up in flight (``_given_up_groups``), in
  train-stream order. A simulation of that run replays them (simulated
  group ``g`` is the run's group at stream position ``g``), so a sync round
  waits for the same longest response its real round did, and a streaming
  run generates the long groups it gave up; fitting the streaming factors
  and ``--validate`` use them. The profile keeps a sample of each run's
  written groups, drawn at random, for simulations of other runs.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from reflow.bench import mode_bench
from reflow.bench.sim_profile import (
    DriverCost,
    EngineCost,
    Lengths,
    MachineCost,
    MeasuredGroups,
    SimProfile,
    SyncCost,
    TrainerCost,
)
from reflow.bench.simulate import STREAMING, config_path, mode_config, simulate
from reflow.infra.run import GIVEN_UP_LOG, load_config_of, load_record, read_given_up, read_steps
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.schema import stream_position

TRACES = "traces.json.gz"  # bench_traces: the runs' workloads, kept beside bench.json


def _median(values: list[float], default: float = 0.0) -> float:
    return float(statistics.median(values)) if values else default


def _mean(values: list[float], default: float = 0.0) -> float:
    return float(statistics.fmean(values)) if values else default


def _round_features(rows: list[tuple[int, int]]) -> tuple[float, float, float]:
    """(decode steps, sequence-steps, context tokens summed over steps) of a round of (prompt, length) requests
    that all start at once."""
    lengths = np.asarray([n for _, n in rows], float)
    prompts = np.asarray([p for p, _ in rows], float)
    return float(lengths.max()), float(lengths.sum()), float(np.sum(prompts * lengths + lengths * (lengths + 1) / 2))


def _subset(groups: list[list[tuple[int, float]]], most: int) -> MeasuredGroups:
    """At most ``most`` of ``groups`` (a fixed random subset, in order)."""
    if len(groups) > most:
        groups = [groups[i] for i in sorted(np.random.default_rng(0).choice(len(groups), most, replace=False))]
    return MeasuredGroups(lengths=[[n for n, _ in g] for g in groups], rewards=[[w for _, w in g] for g in groups])


def _groups_of(run_dir: str, given_up: bool = False) -> list[list[tuple[int, float]]]:
    """(length, reward) of every sample of every group a run wrote, groups in train-stream order
    (``_stream_order``) and samples by index; with ``given_up``, also the groups it gave up in flight, at their
    stream positions (``_given_up_groups``)."""
    record = load_record(run_dir)
    cols = DeltaTrajectoryStore(record.store_root).read_trajectories(run_id=record.run_id).select(
        ["group_id", "sample_index", "response_length", "reward"]).to_pydict()
    groups: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for gid, k, length, reward in zip(cols["group_id"], cols["sample_index"], cols["response_length"], cols["reward"]):
        groups[gid].append((int(k), int(length), float(reward)))
    keyed = {_stream_order(gid): [(n, w) for _, n, w in sorted(groups[gid])] for gid in groups}
    if given_up:
        keyed |= {(position, ""): group for position, group in _given_up_groups(run_dir).items()}
    return [keyed[key] for key in sorted(keyed)]


def _given_up_groups(run_dir: str) -> dict[int, list[tuple[int, float]]]:
    """Stream position -> (length, reward) of each sample of each group a streaming run gave up in flight
    (``infra.run.read_given_up``): its samples that finished first, at their lengths, then one at the run's
    ``rollout.max_response_tokens`` for each sample it never finished, every reward 0.

    Those samples were cut off where the run gave the group up, so their lengths are not known; at the limit, a
    simulation that replays the trace gives the group up again by its own clock, as the run did, and generates
    about what the run generated of it (a shorter guess could finish the group the run gave up). The rewards were
    never scored: 0 for all, a group no trainer would learn from. For this reason the profile's pooled and
    per-run draws (``calibrate``) leave these groups out: a simulation at another scale might run them to the
    limit.
    """
    finished = read_given_up(run_dir)
    if not finished:
        return {}
    rollout = load_config_of(run_dir).rollout
    return {position: [(n, 0.0) for n in lengths[:rollout.samples_per_prompt]]
            + [(rollout.max_response_tokens, 0.0)] * max(0, rollout.samples_per_prompt - len(lengths))
            for position, lengths in finished.items()}


def _stream_order(group_id: str) -> tuple[int, str]:
    """Where a group came in its run's prompt stream: ``<run>/g<position>/<prompt>`` (streaming), or
    ``<run>/<step>/<prompt>`` (a round; its prompts in id order, which is stream order)."""
    _, tag, prompt = group_id.split("/", 2)
    return (stream_position(tag) if tag.startswith("g") else int(tag)), prompt


def _trace(groups: list[list[tuple[int, float]]]) -> MeasuredGroups:
    return MeasuredGroups(lengths=[[n for n, _ in g] for g in groups], rewards=[[w for _, w in g] for g in groups],
                          ordered=True)


def bench_traces(bench_dir: str | Path) -> dict[str, MeasuredGroups]:
    """The workload each run of a bench generated, keyed ``mode:seed``: every group it wrote, lengths and rewards,
    in train-stream order (``MeasuredGroups.ordered``), for a simulation of that run to replay.

    Read from the runs' tables while their directories exist, and then kept beside bench.json as
    ``traces.json.gz`` (written once), which is read when they are gone: bench.json and that file are what a
    stored bench needs for ``--validate``. ValueError naming the first run that has neither.
    """
    bench_dir = Path(bench_dir)
    stored = bench_dir / TRACES
    if stored.is_file():
        try:
            data = json.loads(gzip.decompress(stored.read_bytes()))
            return {key: MeasuredGroups.model_validate(value) for key, value in data.items()}
        except PermissionError as exc:
            raise ValueError(f"{stored}: cannot read it ({exc.strerror})") from exc
        except (OSError, EOFError, zlib.error, ValueError, AttributeError) as exc:  # not gzip, cut short, not traces
            raise ValueError(f"{stored}: not a trace file ({type(exc).__name__}); delete it to rebuild it from the "
                             "runs' tables (while their directories exist)") from exc
    traces = {}
    for r in mode_bench.load_results(bench_dir):
        if not Path(r.run_dir).is_dir():
            raise ValueError(f"{bench_dir}: run {r.mode} seed {r.seed} is gone ({r.run_dir}) and there is no {TRACES}"
                             " beside bench.json: the simulation needs the lengths that run generated")
        traces[f"{r.mode}:{r.seed}"] = _trace(_groups_of(r.run_dir, given_up=True))
    tmp = stored.with_name(stored.name + ".tmp")
    tmp.write_bytes(gzip.compress(json.dumps({k: v.model_dump() for k, v in traces.items()},
                                             separators=(",", ":")).encode(), mtime=0))
    tmp.replace(stored)
    return traces


def unrecorded_given_up(bench_dir: str | Path) -> list[str]:
    """A line for each run of a bench, still on disk, that gave groups up in flight and recorded none of them (a
    run from before ``given_up.jsonl``): its trace holds only the groups it wrote, so its simulation generates
    less than it did."""
    lines = []
    for r in mode_bench.load_results(Path(bench_dir)):
        if not Path(r.run_dir).is_dir() or read_given_up(r.run_dir):
            continue
        steps = read_steps(r.run_dir)
        given_up = int(steps[-1].metrics.get("groups_abandoned", 0)) if steps else 0
        if given_up:
            lines.append(f"run {r.mode} seed {r.seed} gave up {given_up} groups in flight and recorded none of their "
                         f"lengths (no {GIVEN_UP_LOG}: a run from before runs kept one); its trace holds the groups it "
                         "wrote, and its simulation generates less than it did")
    return lines


def with_traces(profile: SimProfile, traces: dict[str, MeasuredGroups]) -> SimProfile:
    """``profile`` whose runs of those modes and seeds replay ``traces`` (``bench_traces``)."""
    lengths = profile.lengths.model_copy(update={"by_run": {**profile.lengths.by_run, **traces}})
    return profile.model_copy(update={"lengths": lengths})


def calibrate(bench_dir: str | Path, seeds: list[int] | None = None, max_groups: int = 1000) -> SimProfile:
    """A CPU profile fitted to the runs of ``bench_dir`` (``seeds``: only those runs; default all).

    The measured groups of every run are kept, keyed by mode and seed (at most ``max_groups / 4`` each, and
    ``max_groups`` pooled, a fixed random subset), so the profile stays a small file.

    Raises ValueError naming what is missing (no bench.json, no sync run, no steps).
    """
    every = mode_bench.load_results(Path(bench_dir))
    results = [r for r in every if seeds is None or r.seed in seeds]
    if not any(r.mode == "sync" for r in results):
        raise ValueError(f"{bench_dir}: calibration needs a sync run (its rounds time the engine alone)")
    label = f"reflow bench {Path(bench_dir).resolve().name}, seeds {sorted({r.seed for r in results})}"
    rounds: list[tuple[float, float, float, float]] = []  # (engine s, L, sum len, sum ctx)
    compute: list[tuple[float, float]] = []  # (trained tokens, seconds): sync steps, the trainer alone
    shared: list[tuple[str, float, float]] = []  # the same beside generation (the other modes)
    overlapped: list[tuple[float, float, float, float, float]] = []  # one_step_off: (round features, overlap)
    overhead, syncs, selects, writes, scores, records, residual, reads = [], [], [], [], [], [], [], []
    groups: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    prompt_tokens: list[int] = []
    weight_bytes = 0
    for r in results:
        steps = read_steps(r.run_dir)
        if not steps:
            raise ValueError(f"{r.run_dir}: no steps recorded")
        record = load_record(r.run_dir)
        weight_bytes = weight_bytes or record.weight_bytes
        table = DeltaTrajectoryStore(record.store_root).read_trajectories(run_id=record.run_id)
        cols = table.select(["group_id", "rollout_step", "prompt_tokens", "response_length", "reward"]).to_pydict()
        by_step: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for gid, step, prompt, length, reward in zip(cols["group_id"], cols["rollout_step"], cols["prompt_tokens"],
                                                     cols["response_length"], cols["reward"]):
            groups[(r.run_dir, gid)].append((int(length), float(reward)))
            prompt_tokens.append(len(prompt))
            by_step[int(step)].append((len(prompt), int(length)))
        before = 0.0  # the step before's compute (one_step_off trains it while the engine runs this round)
        for rec in steps:
            m = rec.metrics
            busy = (1.0 - m.get("trainer_idle_fraction", 1.0)) * m.get("step_seconds", 0.0)
            if m.get("trained_tokens") and 0.001 < m.get("trainer_idle_fraction", 0.0) < 0.999:
                if r.mode == "sync":
                    compute.append((m["trained_tokens"], busy))
                else:
                    shared.append((r.mode, m["trained_tokens"], busy))
                if "update_seconds" in m:
                    overhead.append(max(0.0, m["update_seconds"] - busy))
            if r.mode == "one_step_off" and rec.step > 0 and m.get("rollout_seconds") and by_step.get(rec.step):
                overlapped.append((m["rollout_seconds"], *_round_features(by_step[rec.step]), before))
            before = busy
            if r.mode == "sync":
                if m.get("sync_weights_seconds"):
                    syncs.append(m["sync_weights_seconds"])
                if "score_seconds" in m:
                    scores.append(m["score_seconds"])
                rows = by_step.get(rec.step)
                if rows and m.get("rollout_seconds"):
                    rounds.append((m["rollout_seconds"], *_round_features(rows)))
            if r.mode in ("sync", "one_step_off") and "update_seconds" in m and "sync_weights_seconds" in m:
                # what the flow spent beside its timed tasks (one_step_off's sync waits for the round)
                rest = m["step_seconds"] - m["update_seconds"] - m["sync_weights_seconds"] - m.get("score_seconds", 0.0)
                residual.append((r.mode, rest - (m.get("rollout_seconds", 0.0) if r.mode == "sync" else 0.0)))
            if rec.step > 0 and m.get("trainer_batch_prefetched") == 0 and "trainer_read_seconds" in m:
                reads.append(m["trainer_read_seconds"])  # streaming: the batch read on the step's path
            if "select_seconds" in m:
                selects.append(m["select_seconds"])
                records.append(m.get("previous_log_seconds", 0.0))
            if m.get("writes"):
                writes.append(m["write_seconds"] / m["writes"])
    if len(rounds) < 3 or len(compute) < 3:
        raise ValueError(f"{bench_dir}: too few rounds ({len(rounds)}) or trainer steps ({len(compute)}) to fit")
    a = np.asarray([[L, s, c] for _, L, s, c in rounds])
    y = np.asarray([t for t, *_ in rounds])
    scale = a.max(axis=0)
    coef, _ = nnls(a / scale, y)
    base, per_seq, per_ctx = (coef / scale).tolist()
    fit = a @ (coef / scale)
    x = np.asarray([[1.0, t] for t, _ in compute])
    secs = np.asarray([s for _, s in compute])
    (t0, per_token), *_ = np.linalg.lstsq(x, secs, rcond=None)
    t0, per_token = max(0.0, float(t0)), max(float(per_token), 1e-9)
    # beside generation: the median of measured over alone-predicted compute
    trainer_slow = max(1.0, _median([s / (t0 + per_token * t) for _, t, s in shared], 1.0))
    trainer_by_mode = {mode: max(1.0, _median([s / (t0 + per_token * t) for m, t, s in shared if m == mode]))
                       for mode in dict.fromkeys(m for m, _, _ in shared)}
    # one_step_off rounds beside the update: extra engine seconds per second of overlap
    engine = coef / scale
    engine_slow = max(1.0, 1.0 + _median([(real - float(np.dot(engine, feats)))
                                          / min(over, float(np.dot(engine, feats)))
                                          for real, *feats, over in overlapped if over > 0], 0.0))
    sync_s = _median(syncs)
    # sync records while its next round runs, one_step_off before it submits the next: what one_step_off spends
    # beside its tasks, over sync's, is the record (means: an eval snapshot every few steps weighs in)
    on_path = max(0.0, _mean([x for mode, x in residual if mode == "sync"]))
    recording = max(0.0, _mean([x for mode, x in residual if mode == "one_step_off"], on_path) - on_path)
    resources = load_config_of(next(r.run_dir for r in results if r.mode == "sync")).resources
    cores = float(resources.num_cpus or os.cpu_count() or 1)
    pooled = _subset(list(groups.values()), max_groups)
    # every run's groups, the runs not fitted on included: what each run's policy wrote is the workload a
    # simulation of that run is given, not a figure it is checked on
    by_run = {f"{r.mode}:{r.seed}": _subset(_groups_of(r.run_dir), max_groups // 4) for r in every}
    profile = SimProfile(
        name=f"cpu calibrated from {label}",
        engine=EngineCost(source=f"{label}: nnls of {len(rounds)} sync rounds' rollout_seconds on decode steps, "
                          "sequence-steps and context tokens; weight load: median sync_weights_seconds",
                          step_base_s=base, per_seq_s=per_seq, per_context_token_s=per_ctx, prefill_token_s=0.0,
                          weight_load_s=sync_s, slowdown_while_training=engine_slow),
        trainer=TrainerCost(source=f"{label}: least squares of {len(compute)} sync steps' compute seconds on "
                            "trained tokens; overhead: median update_seconds minus compute; read: median "
                            "trainer_read_seconds of the streaming steps whose batch was not prefetched; "
                            "beside generation: "
                            f"median measured/predicted over {len(shared)} steps of the other modes",
                            step_base_s=t0, token_s=per_token, overhead_s=_median(overhead), read_s=_median(reads),
                            slowdown_while_generating=trainer_slow, slowdown_by_mode=trainer_by_mode),
        sync=SyncCost(source=f"{label}: run.json weight_bytes; the copy's time is in the engine's weight load",
                      fixed_s=0.0, bytes=float(weight_bytes), bytes_per_s=1e12),
        driver=DriverCost(source=f"{label}: medians of select_seconds, write_seconds/writes and "
                          "previous_log_seconds (streaming), of score_seconds (sync rounds), and of the rounds' step "
                          "seconds beside their timed tasks", write_s=_median(writes), select_s=_median(selects),
                          record_s=_median(records), round_score_s=_median(scores),
                          round_overhead_s=on_path, round_record_s=recording),
        lengths=Lengths(source=f"{label}: {len(pooled.lengths)} of the {len(groups)} groups the runs wrote "
                        f"(lengths and rewards), and up to {max_groups // 4} of each run's own "
                        "(every run of the bench)",
                        prompt_tokens=float(np.mean(prompt_tokens)), groups=pooled.lengths,
                        group_rewards=pooled.rewards, by_run=by_run),
        machine=MachineCost(source=f"{label}: resources.num_cpus of its runs (unset: the machine's cores); the "
                            "cores shared evenly, not fitted (docs/simulation.md, \"The elastic pool is not "
                            "validated\")", cores=cores, oversubscription=1.0),
        calibration={"rounds": len(rounds), "one_step_off_rounds": len(overlapped),
                     "engine_fit_error_median": float(np.median(np.abs(fit - y) / y)),
                     "trainer_steps": len(compute), "bench": str(Path(bench_dir).resolve())})
    return _fit_streaming(profile, Path(bench_dir), [r for r in results if r.mode in STREAMING],
                          bench_traces(bench_dir))


def _engine_rate(generated: list[float], busy: list[float]) -> float:
    return sum(generated) / max(sum(busy), 1e-9)


def _fit_streaming(profile: SimProfile, bench_dir: Path, runs: list, traces: dict[str, MeasuredGroups]) -> SimProfile:
    """``engine.streaming_slowdown``: the simulated over the measured engine tokens per busy second of the
    streaming runs, found by simulating them, each replaying its run's ``traces`` (two passes: the factor moves
    the concurrency the loops reach). Either side of 1: the step is fitted on sync's rounds, which run an engine
    from a full batch down to its tail, and a streaming engine runs at its own steady load; where the fit
    overstates that step, the factor is below 1 (docs/simulation.md, "Validation")."""
    if not runs:
        return profile
    replayed = with_traces(profile, traces)
    meta = json.loads((bench_dir / "bench.json").read_text()).get("meta", {})
    config, overrides = config_path(meta.get("config")), list(meta.get("overrides", []))
    equal_steps, text = meta.get("run_length") == "equal steps", meta.get("config_text")
    measured, idle = [], []
    for r in runs:
        steps = [s.metrics for s in read_steps(r.run_dir)]
        idle.append(sum(m["generator_idle_fraction"] * m["step_seconds"] for m in steps))
        measured.append(_engine_rate([m.get("generated_tokens", 0.0) for m in steps],
                                     [m.get("generated_tokens", 0.0) / max(m.get("engine_tokens_per_s", 0.0), 1e-9)
                                      for m in steps if m.get("engine_tokens_per_s")]))
    factors = {r.mode: 1.0 for r in runs}
    for _ in range(2):
        trial = replayed.model_copy(update={"engine": profile.engine.model_copy(
            update={"streaming_slowdown_by_mode": dict(factors)})})
        ratios: dict[str, list[float]] = defaultdict(list)
        for r, real in zip(runs, measured):
            sim = simulate(mode_config(config, overrides, r.mode, r.seed, equal_steps, text), trial, r.seed)
            rate = _engine_rate([s.generated_tokens for s in sim.steps], [s.engine_busy_s for s in sim.steps])
            ratios[r.mode].append(rate / max(real, 1e-9))
        factors = {mode: factors[mode] * _median(values, 1.0) for mode, values in ratios.items()}
    engine = profile.engine.model_copy(update={
        "streaming_slowdown": _median(list(factors.values()), 1.0), "streaming_slowdown_by_mode": factors,
        "source": profile.engine.source + f"; streaming, per mode: simulated over measured engine tokens per busy "
                                          f"second of {len(runs)} streaming runs"})
    profile = profile.model_copy(update={"engine": engine})
    replayed = replayed.model_copy(update={"engine": engine})
    # the engine's idle time the simulation lacks, per drain window: the calls between windows
    gaps = []
    for r, real_idle in zip(runs, idle):
        sim = simulate(mode_config(config, overrides, r.mode, r.seed, equal_steps, text), replayed, r.seed)
        sim_idle = sum(s.generator_idle(sim.engines) * s.step_seconds for s in sim.steps)
        gaps.append((real_idle - sim_idle) / max(sim.windows, 1))
    driver = profile.driver.model_copy(update={
        "window_gap_s": max(0.0, _median(gaps)),
        "source": profile.driver.source + "; window gap: the streaming runs' engine idle seconds the simulation "
                                          "lacks, per drain window (median over the runs)"})
    return profile.model_copy(update={"driver": driver})


def engine_check(profile: SimProfile, figures: dict) -> list[dict]:
    """The profile's engine step against ``reflow bench-engine``'s (its ``bench_engine.json``): at each measured
    number of running sequences ``c``, the modelled tokens per second ``c / step_s(c, context)`` beside the
    measured ones, the engine alone as in that bench.

    A sequence's context is the prompt plus, on average, half of a length-biased response (a running set that
    replaces every finished request holds long responses for longer): ``prompt + E[L^2] / (2 E[L])`` over the
    profile's pooled groups. The bench's steps include admitting new requests; the model's prefill term is the
    profile's. ValueError if the figures have no points or the profile no measured groups.
    """
    points = figures.get("points") if isinstance(figures, dict) else None
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ValueError("engine check: bench_engine.json has no list of points (not written by reflow bench-engine)")
    if not points or profile.lengths.groups is None:
        raise ValueError("engine check: needs bench_engine.json points and a profile with measured groups")
    lengths = np.asarray([n for g in profile.lengths.groups for n in g], float)
    context = profile.lengths.prompt_tokens + float(np.mean(lengths ** 2) / (2 * np.mean(lengths)))
    rows = []
    for p in points:
        c = int(p["concurrency"])
        step = profile.engine.step_s(c, c * context, c / max(float(np.mean(lengths)), 1.0)
                                     * profile.lengths.prompt_tokens)
        modelled = c / step
        rows.append({"concurrency": c, "measured_tokens_per_s": p["tokens_per_s"], "modelled_tokens_per_s": modelled,
                     "measured_step_ms": p["step_ms_median"], "modelled_step_ms": 1000 * step,
                     "error": abs(modelled - p["tokens_per_s"]) / max(p["tokens_per_s"], 1e-9)})
    return rows
