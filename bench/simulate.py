"""``reflow simulate``: the real control plane against modelled engines and trainers, in virtual time.

What runs unchanged: the streaming modes' feeder and selector loops
(``control.feeder``, ``control.selector``, sized by ``control.streaming``
from the config), the staleness gate, the concurrency controller, and the
buffer's selection query (``storage.replay.select_batch``, the same SQL on
the same in-memory window, ``storage.window``). The rounds of ``sync`` and
``one_step_off`` follow the order of ``flows.rl_train._rounds`` step for
step. What is modelled (``bench.sim_profile``): how long an engine step, a
trainer step, a weight push and the driver's appends and queries take, and
how long responses are. No Ray, Prefect, torch or Delta is in the loop;
the threads of the loops take turns in virtual time (``bench.sim_clock``),
so the same seed gives the same result.

Modelled, not measured: rewards (each group draws a pass rate, each sample
a Bernoulli of it; they only order replay by advantage) and learning (a
simulator cannot learn; ``bench.sim_report`` reads time to target as the
new samples a real run needed over the simulated rate of new samples).

The elastic pool (``resources.flex_workers``, streaming modes) runs the
real ``control.roles`` scheduler: a flex worker is one more modelled engine
while it generates; moved to training, it gives back what it holds
(``pool.in_flight = "move"``; resumed elsewhere by prefill) and, once
ready, computes an equal token share of each step; the weights go to each
helper and its gradients come back through the trainer's one link, one
full copy after another (``sync``'s cost per copy).

Where the model is coarser than a run: every engine of the pool steps in
the same windows (a real pool's engines end their windows independently);
the driver's work takes the profile's fixed times, not a share of a CPU
the roles also use; there are no checkpoints, evaluations or restarts.
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import statistics
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from reflow.bench import mode_bench
from reflow.bench.sim_clock import SimScheduler
from reflow.bench.sim_profile import SimProfile
from reflow.config.load import load_config
from reflow.config.schema import ReflowConfig
from reflow.control.clock import VirtualClock
from reflow.control.feeder import Drained, Finished, Released
from reflow.control.selector import StepOutcome
from reflow.control.sorted_rounds import PooledRoundEngine, RoundGoal, SortedScheduler
from reflow.control.streaming import StreamingLoops
from reflow.storage.replay import ReplayPolicy, ReplaySelection, replay_weight, select_batch
from reflow.storage.schema import GenRequest, GenResult, RoundRun, SampleId, stream_tag
from reflow.storage.store import TRAJECTORIES, USAGE
from reflow.storage.window import WINDOW_SCHEMAS, SelectionWindow, run_sql

RUN = "sim"
STREAMING = ("async", "reflow")
MODES = ("sync", "one_step_off", "async", "reflow", "sorted_on_policy", "sorted_partial")  # bench rows


class SimSample(NamedTuple):
    """A finished response as the feeder's ``Finished.result``: what the loops and the buffer read (a tuple: a
    large simulation makes tens of thousands a step, a frozen dataclass took four times as long to build)."""

    request_id: str
    group: int
    sample: int
    version: int  # the version of its oldest token
    length: int
    reward: float
    trained: bool  # its group's rewards differ (an all-equal group has zero advantage: the trainer skips it)
    engine: int = 0  # the engine that finished it
    resumed: int = 0  # tokens of it another engine generated before it was moved to this one


# A waiting request: (group, sample, tokens to generate, tokens already generated (a resumed partial), version of its
# first token or -1)
Request = tuple[int, int, int, int, int]


@dataclass
class _Engine:
    """One engine's requests: running (by admission, each with the engine step it finishes at) and waiting.

    Decode steps are counted on the engine (``clock``): a sequence admitted at
    step ``a`` with context ``c`` has ``c + clock - a`` tokens in context, so
    the context of all running sequences is ``base + running * clock``, and
    the next to finish is the head of a heap. A step of the model costs
    O(1); a finish, O(log running).
    """

    max_sequences: int
    version: int = 0
    loaded_at: float = 0.0  # when the version it holds arrived
    clock: int = 0  # decode steps taken
    # admission number -> [group, sample, version of its first token, tokens it came with (a moved one), context at
    # admission, clock at admission, clock it finishes at], in admission order
    running: dict[int, list[int]] = field(default_factory=dict)
    heap: list[tuple[int, int]] = field(default_factory=list)  # (clock it finishes at, admission number)
    base: int = 0  # sum over running of (context at admission - clock at admission)
    admitted: int = 0
    waiting: deque[Request] = field(default_factory=deque)  # in admission order

    @property
    def requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def admit(self, request: Request, prompt_tokens: int) -> int:
        """Start ``request`` (its first token is sampled at this version unless it came with one); its context."""
        g, k, remaining, prefix, first = request
        context = prompt_tokens + prefix
        self.running[self.admitted] = [g, k, first if first >= 0 else self.version, prefix, context, self.clock,
                                       self.clock + remaining]
        heapq.heappush(self.heap, (self.clock + remaining, self.admitted))
        self.base += context - self.clock
        self.admitted += 1
        return context

    def context(self, slot: list[int]) -> int:
        """Tokens in context of a running ``slot`` (prompt and response so far)."""
        return slot[4] + self.clock - slot[5]

    def finished(self) -> list[list[int]]:
        """The running sequences whose last token came with the last step (admission order), removed."""
        done = []
        while self.heap and self.heap[0][0] <= self.clock:
            _, key = heapq.heappop(self.heap)
            slot = self.running.pop(key, None)
            if slot is not None:  # else dropped before (``keep``)
                self.base -= slot[4] - slot[5]
                done.append(slot)
        return done

    def next_finish(self) -> int:
        """Steps until the next running sequence finishes."""
        while self.heap[0][1] not in self.running:
            heapq.heappop(self.heap)
        return self.heap[0][0] - self.clock

    def keep(self, groups: set[int] | None = None) -> None:
        """Only the running sequences of ``groups`` stay (None: none)."""
        self.running = {key: slot for key, slot in self.running.items() if groups is not None and slot[0] in groups}
        self.heap = [(slot[6], key) for key, slot in self.running.items()]
        heapq.heapify(self.heap)
        self.base = sum(slot[4] - slot[5] for slot in self.running.values())


@dataclass
class Window:
    """What one stepping window of the pool did."""

    end: float
    finished: list[SimSample]
    busy_s: float  # engine-seconds spent stepping, summed over engines
    slot_s: float  # running sequences x step seconds, summed (for the bubble)
    busy_by_engine: dict[int, float] = field(default_factory=dict)  # engine index -> its stepping seconds
    # (engine, request, tokens the engine generated of it) given back before the window (``EnginePool.release``), a
    # request as ``_Engine.waiting``
    released: list[tuple[int, Request, int]] = field(default_factory=list)


class EnginePool:
    """``engines`` modelled engines (``profile.engine``); lengths and rewards drawn when a group is submitted."""

    def __init__(self, profile: SimProfile, engines: int, max_sequences: int, samples: int, rng: np.random.Generator,
                 max_response_tokens: int, mode: str | None = None, seed: int | None = None) -> None:
        self.cost, self.lengths, self.rng, self.mode = profile.engine, profile.lengths, rng, mode
        self.measured = profile.lengths.source_for(mode, seed)
        self.prompt_tokens = int(round(profile.lengths.prompt_tokens))
        self.samples, self.max_response_tokens = samples, max_response_tokens
        self.engines = [_Engine(max_sequences) for _ in range(engines)]
        self.rewards: dict[int, np.ndarray] = {}
        self.varied: dict[int, bool] = {}  # group -> its rewards differ (an all-equal group is not trained)
        self.lengths_of: dict[int, np.ndarray] = {}
        self.pushed: list[tuple[float, int]] = []  # (arrival time, version) of weights on their way
        self.training: list[tuple[float, float, int]] = []  # the trainer's compute intervals, and actors computing
        self.machine = profile.machine
        self.streaming = profile.engine.streaming(mode) if mode in STREAMING else 1.0
        self.releasing: set[int] = set()  # engines to give back what they hold before their next window

    def submit(self, groups: Sequence[int], spread: str = "least_loaded", to: int | None = None) -> None:
        """Whole groups: to engine ``to`` (the streaming feeder deals them), else each to the engine with the
        fewest requests or round-robin (rounds)."""
        for i, g in enumerate(groups):
            index = (to if to is not None else
                     min(range(len(self.engines)), key=lambda j: self.engines[j].requests)
                     if spread == "least_loaded" else i % len(self.engines))
            engine = self.engines[index]
            engine.waiting += [(g, k, int(n), 0, -1) for k, n in enumerate(self.group_lengths(g))]

    def group_lengths(self, g: int) -> np.ndarray:
        """The response lengths of group ``g``'s samples (drawn with its rewards the first time it is asked)."""
        if g not in self.lengths_of:
            lengths, self.rewards[g] = self.lengths.group(self.rng, self.samples, self.measured, g)
            self.varied[g] = bool(self.rewards[g].min() != self.rewards[g].max())
            self.lengths_of[g] = np.minimum(lengths, self.max_response_tokens)
        return self.lengths_of[g]

    def abandon(self, groups: Sequence[int]) -> None:
        drop = set(groups)
        for e in self.engines:
            if any(slot[0] in drop for slot in e.running.values()):
                e.keep({slot[0] for slot in e.running.values()} - drop)
            e.waiting = deque(w for w in e.waiting if w[0] not in drop)
        self.forget(drop)

    def forget(self, groups: Iterable[int]) -> None:
        """Groups no engine will run again (written whole, or abandoned): their lengths and rewards go."""
        for g in groups:
            self.lengths_of.pop(g, None)
            self.rewards.pop(g, None)
            self.varied.pop(g, None)

    def release(self, index: int) -> None:
        self.releasing.add(index)

    def resubmit(self, requests: Sequence[Request], to: int) -> None:
        """Requests another engine gave back: queued on engine ``to``, to prefill prompt and prefix again."""
        self.engines[to].waiting += list(requests)

    def _give_back(self, index: int) -> list[tuple[int, Request, int]]:
        """Everything engine ``index`` holds, as waiting requests (running ones with what they generated), each with
        the tokens this engine generated of it."""
        e = self.engines[index]
        out = [(index, (g, k, finish - e.clock, e.context(slot) - self.prompt_tokens, first),
                e.context(slot) - self.prompt_tokens - resumed)
               for slot in e.running.values() for g, k, first, resumed, _, _, finish in [slot]]
        out += [(index, r, 0) for r in e.waiting]
        e.keep()
        e.waiting.clear()
        return out

    def push(self, version: int, arrives: float) -> None:
        self.pushed.append((arrives, version))

    def trainer_busy(self, t: float) -> bool:
        """Whether the trainer computes at ``t`` (intervals that ended are dropped)."""
        while self.training and self.training[0][1] <= t:
            self.training.pop(0)
        return bool(self.training) and self.training[0][0] <= t

    def training_actors(self, t: float) -> int:
        """Actors computing a step at ``t``: the trainer and the flex workers helping it."""
        return self.training[0][2] if self.trainer_busy(t) else 0

    def generating(self) -> int:
        """Engines holding requests."""
        return sum(1 for e in self.engines if e.requests)

    @property
    def in_flight(self) -> int:
        return sum(e.requests for e in self.engines)

    def step(self, start: float, window_s: float) -> Window:
        """Every engine with requests steps from ``start`` for about ``window_s`` (a step that starts inside the
        window finishes, as in ``infra.actors.EngineWorker.drain``); new weights load first."""
        finished: list[SimSample] = []
        end, busy, slots = start, 0.0, 0.0
        by_engine: dict[int, float] = {}
        released = [item for index in sorted(self.releasing) for item in self._give_back(index)]
        self.releasing.clear()
        for index, e in enumerate(self.engines):
            t = start
            arrived = [v for at, v in self.pushed if at <= start and v > e.version]
            if arrived:
                e.version = max(arrived)
                t += self.cost.weight_load_s
            if not e.requests:
                continue
            began = t  # the window starts once the load is done (a separate call on the engine actor)
            until = began + window_s  # one bound for this loop and _run's (``t - began < window_s`` can differ)
            while e.requests and t < until:
                prefill = self._admit(e)
                t, s = self._run(e, index, t, until, prefill, finished)
                slots += s
            busy += t - began
            by_engine[index] = t - began
            end = max(end, t)
        self.pushed = [(at, v) for at, v in self.pushed if v > min(e.version for e in self.engines)]
        return Window(end, finished, busy, slots, by_engine, released)

    def _admit(self, e: _Engine) -> int:
        """Fill free slots from the waiting requests; their prompt tokens are prefilled in the next step."""
        room = e.max_sequences - len(e.running)
        if room <= 0 or not e.waiting:
            return 0
        new = [e.waiting.popleft() for _ in range(min(room, len(e.waiting)))]
        # a resumed partial prefills its prefix again (its KV cache went with the weights)
        return sum(e.admit(request, self.prompt_tokens) for request in new)

    def _run(self, e: _Engine, index: int, t: float, until: float, prefill: int,
             out: list[SimSample]) -> tuple[float, float]:
        """Steps until the next response finishes or ``until`` passes; (time after, slot-seconds)."""
        n = len(e.running)
        horizon = e.next_finish()
        slow = (self.cost.slowdown_while_training if self.trainer_busy(t) else 1.0) * self.streaming
        if self.machine.cores is not None:  # actors sharing the cores: counted when the engine's step starts
            slow *= self.machine.factor(self.generating() + self.training_actors(t))
        context = float(e.base + n * e.clock)
        steps, began = 0, t
        if steps < horizon and t < until:  # the first step prefills what was admitted
            t += self.cost.step_s(n, context, prefill) * slow
            context += n
            steps = 1
        if steps < horizon and t < until:  # the decode steps after it, to the next finish or past ``until``
            k = self._decode_steps(n, context, slow, until - t, horizon - steps)
            t += self._decode_s(n, context, slow, k)
            steps += k
        slots = n * (t - began)
        e.clock += steps
        for slot in e.finished():
            g, k, first, resumed = slot[:4]
            out.append(SimSample(f"g{g}/{k}", g, k, first, e.context(slot) - self.prompt_tokens,
                                 float(self.rewards[g][k]), self.varied[g], index, resumed))
        return t, slots

    def _decode_s(self, n: int, context: float, slow: float, k: int) -> float:
        """Seconds of ``k`` decode steps of ``n`` sequences from ``context`` tokens in context (each step adds ``n``):
        the step's cost is linear in the context, so the steps' times are an arithmetic series."""
        cost = self.cost
        first = cost.step_base_s + cost.per_seq_s * n + cost.per_context_token_s * context
        return slow * (k * first + cost.per_context_token_s * n * k * (k - 1) / 2)

    def _decode_steps(self, n: int, context: float, slow: float, room_s: float, most: int) -> int:
        """How many decode steps run: the first whose end reaches ``room_s`` seconds from now, at most ``most``
        (a step that starts inside the window finishes). Solved, then checked against ``_decode_s``: one step at a
        time was most of a large simulation's time."""
        if not math.isfinite(room_s):
            return most
        cost = self.cost
        first = cost.step_base_s + cost.per_seq_s * n + cost.per_context_token_s * context
        half = cost.per_context_token_s * n / 2
        need = room_s / slow  # k * first + half * k * (k - 1) >= need
        if half > 0:
            b = first - half
            k = math.ceil((-b + math.sqrt(b * b + 4 * half * need)) / (2 * half))
        else:
            k = math.ceil(need / first) if first > 0 else most
        k = max(1, min(most, k))
        while k > 1 and self._decode_s(n, context, slow, k - 1) >= room_s:
            k -= 1
        while k < most and self._decode_s(n, context, slow, k) < room_s:
            k += 1
        return k


class _RoundOnEngine:
    """``control.sorted_rounds.RoundEngine`` over one modelled engine of the pool: a SortedRL round from ``start``.

    As ``policies.rounds.run_round``: the queue is taken from its front into
    every free slot, the engine steps until ``goal.met()`` (checked at every
    finish), and whatever still runs is aborted with its tokens so far. A
    resumed partial prefills its prompt and prefix again (``kv_on_update =
    "keep"``'s parking is not modelled). Each sample's final length is drawn
    once, so a resumed one ends where it would have.
    """

    def __init__(self, pool: EnginePool, index: int) -> None:
        self.pool, self.index, self.engine = pool, index, pool.engines[index]
        self.max_sequences = self.engine.max_sequences
        self.start = 0.0
        self.busy = 0.0  # stepping seconds of the last round

    def run_round(self, queue: Sequence[GenRequest], goal: RoundGoal) -> RoundRun:
        pool, e = self.pool, self.engine
        for r in queue:
            sample = SampleId.parse(r.request_id)
            g, k, prefix = sample.stream_position, sample.sample, len(r.resume_tokens)
            e.waiting.append((g, k, int(pool.group_lengths(g)[k]) - prefix, prefix,
                              r.resume_versions[0] if prefix else -1))
        t, slots, started, finished = self.start, 0.0, 0, []
        while e.requests and not goal.met():
            waiting = len(e.waiting)
            prefill = pool._admit(e)
            started += waiting - len(e.waiting)
            out: list[SimSample] = []
            t, busy = pool._run(e, self.index, t, math.inf, prefill, out)
            slots += busy
            for sample in out:
                result = _result(sample.group, sample.sample, sample.length, sample.version, e.version, "stop")
                goal.observe(result)
                finished.append(result)
        aborted = [_result(slot[0], slot[1], e.context(slot) - pool.prompt_tokens, slot[2], e.version, "abort")
                   for slot in e.running.values()]
        e.keep()
        e.waiting.clear()
        self.busy = t - self.start
        return RoundRun(finished=finished, aborted=aborted, started=started, seconds=t - self.start,
                        busy_slot_seconds=slots, steps=0)


def _result(g: int, k: int, length: int, first: int, version: int, reason: str) -> GenResult:
    """A modelled response as the engine returns it: ``length`` tokens, the first sampled at ``first``.

    Its per-token fields are arrays, not lists: a round at 128 GPUs holds tens of thousands of responses of
    thousands of tokens, and the cycle collector scans every item of a list, never an array's; 4 bytes an item
    where a list's pointer takes 8 (the control plane reads them as sequences: their lengths, the first version,
    the oldest).
    """
    versions = array("i", [version]) * length
    if length:
        versions[0] = first
    return GenResult(SampleId(stream_tag(g), f"p{g}", k).request_id, array("i", bytes(4 * length)),
                     array("f", bytes(4 * length)), reason, versions, first)


def loss_tokens(sample: SimSample) -> int:
    """Tokens the trainer computes for ``sample``: its response, unless its advantage is zero (skipped)."""
    return sample.length if sample.trained else 0


class SimBuffer:
    """The buffer's selection over modelled rows: ``TrajectoryStore.select`` on a ``SelectionWindow``, as the
    Delta store runs it, fed by the simulated appends.

    It keeps the window only (the Delta store keeps every row in its tables): the run's floors only rise, so
    the rows and loss tokens below the floor are never read again, and a simulation's memory follows the
    window, not the run.
    """

    def __init__(self) -> None:
        self.window = SelectionWindow(RUN, -(2**62), {})  # every version, until the first selection advances it
        self.tokens: dict[str, int] = {}  # trajectory id -> loss tokens the trainer computes (0: skipped)
        self._ids: dict[int, list[str]] = {}  # policy version -> its trajectory ids in ``tokens``
        self._appended: list[SimSample] = []  # since the last selection

    def append(self, samples: Sequence[SimSample]) -> None:
        """A commit's rows: they reach the window as one table at the next selection (the window reads them
        then; an Arrow table per commit was a tenth of a large simulation's control plane)."""
        self._appended += samples
        for s in samples:
            if s.version >= self.window.floor:  # older rows never enter the window
                self.tokens[s.request_id] = loss_tokens(s)
                self._ids.setdefault(s.version, []).append(s.request_id)

    def record_usage(self, selection: ReplaySelection) -> None:
        rows = {"run_id": [RUN] * len(selection.trajectory_ids), "trajectory_id": selection.trajectory_ids,
                "trainer_version": [selection.trainer_version] * len(selection.trajectory_ids)}
        self.window.add(USAGE, pa.table(rows, schema=WINDOW_SCHEMAS[USAGE]))

    def select(self, run_id: str, floor: int, sql: str) -> pa.Table:
        """``TrajectoryStore.select``: the selection's SQL over the window from ``floor`` on."""
        if floor < self.window.floor:  # the Delta store would read its tables afresh; the rows are gone here
            raise ValueError(f"simulated buffer: a selection from version {floor}, below the window's floor "
                             f"{self.window.floor} (the floors of a run only rise)")
        samples, self._appended = self._appended, []
        if samples:
            rows = {"run_id": [RUN] * len(samples), "trajectory_id": [s.request_id for s in samples],
                    "group_id": [f"g{s.group}" for s in samples], "sample_index": [s.sample for s in samples],
                    "policy_version": [s.version for s in samples], "reward": [s.reward for s in samples]}
            self.window.add(TRAJECTORIES, pa.table(rows, schema=WINDOW_SCHEMAS[TRAJECTORIES]))
        self.window.advance(floor)
        for version in [v for v in self._ids if v < floor]:
            for trajectory in self._ids.pop(version):
                self.tokens.pop(trajectory, None)
        return run_sql(self.window.tables(), sql)


@dataclass(frozen=True)
class SimStep:
    """One simulated step's figures (the names of the real per-step metrics)."""

    step: int
    elapsed_s: float
    step_seconds: float
    trainer_seconds: float
    engine_busy_s: float  # engine-seconds in the step, summed over engines
    generated_tokens: int
    samples: int
    new_samples: int
    trained_tokens: int
    staleness_mean: float
    replay_share: float
    bubble_ratio: float | None = None  # rounds

    def trainer_idle(self) -> float:
        return min(1.0, max(0.0, 1.0 - self.trainer_seconds / max(self.step_seconds, 1e-9)))

    def generator_idle(self, engines: int) -> float:
        return min(1.0, max(0.0, 1.0 - self.engine_busy_s / max(engines * self.step_seconds, 1e-9)))


@dataclass
class SimRun:
    mode: str
    seed: int
    engines: int
    trainer_ranks: int
    steps: list[SimStep]
    origin: float = 0.0  # virtual time of the first submit
    windows: int = 0  # streaming: drain windows started
    switches: int = 0  # the elastic pool's role switches
    helper_steps: int = 0  # steps a flex worker computed a share of
    # streaming: CPU seconds of the simulation's threads, and of those spent in the models (engines, trainer); the
    # rest is the control plane's (the loops, gate, controllers, scheduler, selection query; the turn hand-overs)
    cpu_s: float = 0.0
    model_cpu_s: float = 0.0


@contextmanager
def _modelled(run: SimRun) -> Iterator[None]:
    """Count the CPU of the block (in this thread, which does not give up its turn in it) as the models'."""
    start = time.thread_time()
    try:
        yield
    finally:
        run.model_cpu_s += time.thread_time() - start


class _Feeder:
    """``control.feeder.FeederBackend`` over the modelled pool and buffer."""

    def __init__(self, sched: SimScheduler, pool: EnginePool, buffer: SimBuffer, profile: SimProfile,
                 run: SimRun) -> None:
        self.sched, self.pool, self.buffer, self.driver, self.run = sched, pool, buffer, profile.driver, run
        self.samples_per_group = pool.samples
        self.windows = 0

    def submit(self, groups: Sequence[int], engine: int = 0) -> None:
        with _modelled(self.run):
            self.pool.submit(groups, to=engine)

    def start_drain(self, window_s: float) -> Window:
        self.windows += 1
        with _modelled(self.run):
            return self.pool.step(self.sched.now() + self.driver.window_gap_s, window_s)

    def wait_drain(self, handle: Window) -> Drained:
        self.sched.wait_until(handle.end)
        with _modelled(self.run):
            items = [Finished(s.group, s, s.length - s.resumed, s.engine) for s in handle.finished]
            released = [Released(request[0], request, engine, tokens) for engine, request, tokens in handle.released]
        # busy_s is the pool's mean, as the real feeder's (``Drained``): the scheduler's engine wait reads it
        return Drained(items, busy_s=handle.busy_s / len(self.pool.engines), in_flight=self.pool.in_flight,
                       busy_by_engine=handle.busy_by_engine, released=released)

    def release(self, engine: int) -> None:
        with _modelled(self.run):
            self.pool.release(engine)

    def resubmit(self, requests: Sequence[Request], engine: int) -> None:
        with _modelled(self.run):
            self.pool.resubmit(requests, engine)

    def write(self, chunk: int, groups: dict[int, list[Finished]]) -> None:
        samples = [f.result for g in sorted(groups) for f in groups[g]]
        self.sched.sleep(self.driver.write_s + self.driver.write_sample_s * len(samples))
        self.buffer.append(samples)
        self.pool.forget(groups)

    def abandon(self, groups: Sequence[int]) -> None:
        with _modelled(self.run):
            self.pool.abandon(groups)

    def gave_up(self, finished: dict[int, list[Finished]]) -> None:
        pass  # the loop state counts the groups given up (``LoopState.groups_abandoned``); no trace is kept


@dataclass
class _Update:
    step: int
    selection: ReplaySelection
    end: float
    seconds: float
    tokens: int


class _Selector:
    """``control.selector.SelectorBackend``: the real query on the buffer, a modelled trainer and push."""

    def __init__(self, sched: SimScheduler, cfg: ReflowConfig, pool: EnginePool, buffer: SimBuffer,
                 profile: SimProfile, loops: StreamingLoops, run: SimRun, progress: Callable[[int], None]) -> None:
        self.sched, self.cfg, self.pool, self.buffer, self.profile = sched, cfg, pool, buffer, profile
        self.loops, self.run, self.progress = loops, run, progress
        b = cfg.buffer
        replay = cfg.mode.kind == "reflow"
        self.policy = ReplayPolicy(max_staleness_versions=b.max_staleness_versions,
                                   replay_ratio=b.replay_ratio if replay else 0.0,
                                   max_reuse=b.max_reuse if replay else 1, replay_order=b.replay_order)
        self.weight_fn = lambda reuse, age: replay_weight(reuse, age, b.reuse_decay, b.staleness_decay)
        self.version = 0
        self.trainer_free = 0.0
        self.done: dict[int, _Update] = {}
        self.last_record = 0.0
        self.seen_busy, self.seen_tokens = 0.0, 0
        self.prefetched: ReplaySelection | None = None

    def select(self, step: int, trainer_version: int) -> ReplaySelection:
        self.sched.sleep(self.profile.driver.select_s)
        return select_batch(self.buffer, RUN, trainer_version, self.cfg.rollout.prompts_per_step, self.policy,
                            self.weight_fn, samples_per_prompt=self.cfg.rollout.samples_per_prompt)

    def consumed(self, selection: ReplaySelection) -> tuple[int, ...]:
        return tuple(sorted(int(g[1:]) for g in {g for g, k in zip(selection.group_ids, selection.kinds)
                                                 if k != "replay"}))

    def prefetch(self, selection: ReplaySelection) -> None:
        self.prefetched = selection  # read while the step before computes: off the next step's path

    def start_train(self, step: int, selection: ReplaySelection) -> _Update:
        self.buffer.record_usage(selection)
        with _modelled(self.run):
            return self._model_step(step, selection)

    def _model_step(self, step: int, selection: ReplaySelection) -> _Update:
        tokens = sum(self.buffer.tokens[t] for t in selection.trajectory_ids)
        # flex workers ready to train take an equal token share; each loads the weights and returns gradients
        helpers = len(self.loops.pool.ready()) if self.loops.pool is not None else 0
        share = math.ceil(tokens / (1 + helpers))
        # the engines generate all along in the streaming modes: the step shares the machine with them (and, on
        # shared cores, with every engine holding requests as it starts)
        machine = self.profile.machine
        shared = machine.factor(1 + helpers + self.pool.generating()) if machine.cores is not None else 1.0
        seconds = self.profile.trainer.step_s(share, self.cfg.resources.trainer_ranks) \
            * self.profile.trainer.slowdown(self.cfg.mode.kind) * shared + self._helper_transfer_s(helpers)
        self.run.helper_steps += helpers > 0
        read = 0.0 if selection is self.prefetched else self.profile.trainer.read_s
        begin = max(self.sched.now(), self.trainer_free) + self.profile.trainer.overhead_s + read
        self.trainer_free = begin + seconds
        self.pool.training.append((begin, self.trainer_free, 1 + helpers))
        return _Update(step, selection, self.trainer_free, seconds, tokens)

    def _helper_transfer_s(self, helpers: int) -> float:
        """The weights to ``helpers`` flex workers and their gradients back, each a full copy through the
        trainer's one link (``sync``'s cost per copy, one after the other: ``policies.trainer`` adds the
        helpers' gradients on rank 0)."""
        sync = self.profile.sync
        return 2 * (sync.fixed_s + helpers * sync.bytes / sync.bytes_per_s) if helpers else 0.0

    def finish_train(self, handle: _Update, timeout: float | None) -> StepOutcome | None:
        self.sched.wait_until(handle.end if timeout is None else min(handle.end, self.sched.now() + timeout))
        if self.sched.now() < handle.end:
            return None
        self.version += 1
        self.done[handle.step] = handle
        sel = handle.selection
        return StepOutcome(version=self.version, groups=len(set(sel.group_ids)), consumed=self.consumed(sel))

    def push_weights(self, version: int) -> None:
        self.pool.push(version, self.sched.now() + self.profile.sync.seconds())

    def uses_trainer(self, step: int) -> bool:
        return False

    def record(self, step: int) -> None:
        self.sched.sleep(self.profile.driver.record_s)
        update = self.done.pop(step)
        sel = update.selection
        now = self.sched.now()
        state = self.loops.state
        busy, tokens = state.engine_busy_s - self.seen_busy, state.generated_tokens - self.seen_tokens
        self.seen_busy, self.seen_tokens = state.engine_busy_s, state.generated_tokens
        busy *= len(self.pool.engines)  # the pool's mean (``Drained.busy_s``) back to engine-seconds
        staleness = sel.staleness
        self.run.steps.append(SimStep(
            step=step, elapsed_s=now - self.run.origin, step_seconds=now - self.last_record,
            trainer_seconds=update.seconds, engine_busy_s=busy, generated_tokens=tokens,
            samples=len(sel.trajectory_ids), new_samples=sum(k != "replay" for k in sel.kinds),
            trained_tokens=update.tokens, staleness_mean=statistics.fmean(staleness) if staleness else 0.0,
            replay_share=sel.replay_share))
        self.last_record = now
        self.progress(1)


def _streaming(cfg: ReflowConfig, profile: SimProfile, seed: int, progress: Callable[[int], None]) -> SimRun:
    sched = SimScheduler()
    engines = cfg.resources.engines + cfg.resources.flex_workers  # the flex workers after the main engines
    run = SimRun(cfg.mode.kind, seed, engines, cfg.resources.trainer_ranks, [])
    pool = EnginePool(profile, engines, cfg.rollout.max_concurrent_sequences, cfg.rollout.samples_per_prompt,
                      np.random.default_rng(seed), cfg.rollout.max_response_tokens, cfg.mode.kind, seed)
    buffer = SimBuffer()
    loops = StreamingLoops(cfg, sched, engines=engines)
    loops.state.cond = sched.condition()  # the loops meet on it; in virtual time
    feed = _Feeder(sched, pool, buffer, profile, run)
    feeder = loops.feeder(feed)
    selector = loops.selector_loop(_Selector(sched, cfg, pool, buffer, profile, loops, run, progress))
    total = cfg.run.total_steps

    def main() -> None:  # what StreamingLoops.run does, with the feeder in a simulated thread
        task = sched.spawn(feeder.run, "feeder")
        try:
            selector.run(range(total))
        finally:
            loops.state.request_stop()
            sched.join(task)

    sched.run(main)
    run.cpu_s = sched.cpu_s
    run.windows = feed.windows
    if loops.pool is not None:
        run.switches = loops.pool.scheduler.switches
    if loops.state.error is not None:
        raise RuntimeError(f"{cfg.mode.kind}: the simulated feeder failed") from loops.state.error
    return run


def _rounds(cfg: ReflowConfig, profile: SimProfile, seed: int, progress: Callable[[int], None]) -> SimRun:
    """``sync`` and ``one_step_off`` in the order of ``flows.rl_train._rounds`` (plain rounds).

    Each role is a time at which it is next free: the engines run a round
    (one weight load queued behind it in ``one_step_off``), the flow scores it
    and logs, the trainer trains. No loop of the control plane runs here:
    the flow's order is the rounds' whole control.
    """
    engines, groups = cfg.resources.engines, cfg.rollout.prompts_per_step
    r = cfg.rollout
    name = cfg.mode.kind if r.scheduling == "plain" else r.scheduling
    run = SimRun(name, seed, engines, cfg.resources.trainer_ranks, [])
    pool = EnginePool(profile, engines, cfg.rollout.max_concurrent_sequences, cfg.rollout.samples_per_prompt,
                      np.random.default_rng(seed), cfg.rollout.max_response_tokens, cfg.mode.kind, seed)
    overlap = cfg.mode.kind == "one_step_off"
    driver = profile.driver
    sync_s = profile.sync.seconds() + profile.engine.weight_load_s
    total = cfg.planned_steps()

    parts = [_RoundOnEngine(pool, i) for i in range(engines)]
    sched = SortedScheduler(
        groups, r.samples_per_prompt, r.oversubscription, r.scheduling.removeprefix("sorted_"),
        lambda g, k, resume: GenRequest(
            SampleId(stream_tag(g), f"p{g}", k).request_id, [], r.max_response_tokens,
            *((resume.response_tokens, resume.logprobs, resume.token_versions) if resume else ())),
        VirtualClock(), early_stop=r.early_stop, round_tokens=r.round_tokens,
        max_aborts=r.max_aborts) if r.scheduling != "plain" else None

    def rollout(step: int, start: float, version: int) -> _Round:
        for e in pool.engines:
            e.version = version
        if sched is not None:  # a SortedRL round: the real scheduler over the modelled engines
            for part in parts:
                part.start = start
            result = sched.run_round(parts[0] if engines == 1 else PooledRoundEngine(parts))
            st = result.stats
            samples = []
            for g, items in result.trainable.items():
                rewards = pool.rewards[g]
                samples += [SimSample(res.request_id, g, k, min(res.token_versions), len(res.response_tokens),
                                      float(rewards[k]), bool(rewards.min() != rewards.max()))
                            for k, res in enumerate(items)]
            return _Round(start, start + st.seconds, samples, sum(part.busy for part in parts),
                          st.busy_slot_seconds, st.slots, version, st.generated_tokens)
        pool.submit(range(step * groups, (step + 1) * groups), spread="round_robin")
        slots = sum(min(e.requests, e.max_sequences) for e in pool.engines)
        w = pool.step(start, math.inf)  # every engine runs until its share is done
        return _Round(start, w.end, w.finished, w.busy_s, w.slot_s, slots, version)

    engine_free = trainer_free = last_record = flow = 0.0
    version = 0
    pending = rollout(0, 0.0, 0)
    engine_free = pending.end
    for step in range(total):
        done = pending
        flow = max(flow, done.end) + driver.round_score_s + driver.write_sample_s * len(done.finished)
        last = step == total - 1
        tokens = sum(loss_tokens(s) for s in done.finished)
        train_s = profile.trainer.step_s(tokens, cfg.resources.trainer_ranks)
        if overlap and not last:  # the trainer shares the machine with the next round (on every engine)
            train_s *= profile.trainer.slowdown(cfg.mode.kind) * profile.machine.factor(1 + len(pool.engines))
        begin = max(flow, trainer_free) + profile.trainer.overhead_s
        trainer_free = begin + train_s
        if overlap and not last:  # the engine starts the next round on the weights it holds, beside the update
            pool.training = [(begin, trainer_free, 1)]
            pending = rollout(step + 1, max(flow, engine_free), version)
            engine_free = pending.end
        version += 1
        # the weight sync (a blocking task) runs on the engines after the round they have: in one_step_off it
        # queues behind the next round, so the flow waits for that round too
        engine_free = max(trainer_free, engine_free) + sync_s
        flow = engine_free + driver.round_overhead_s
        if not overlap and not last:  # sync submits the next round before it records the step
            pending = rollout(step + 1, flow, version)
            engine_free = pending.end
        flow += driver.round_record_s  # one_step_off: the next round is submitted after it (next step's score)
        span = max(done.end - done.start, 1e-9)
        run.steps.append(SimStep(
            step=step, elapsed_s=flow, step_seconds=flow - last_record, trainer_seconds=train_s,
            engine_busy_s=done.busy_s,
            generated_tokens=done.generated if done.generated is not None else sum(s.length for s in done.finished),
            samples=len(done.finished), new_samples=len(done.finished), trained_tokens=tokens,
            staleness_mean=statistics.fmean(version - 1 - s.version for s in done.finished) if done.finished
            else 0.0, replay_share=0.0,
            bubble_ratio=max(0.0, 1.0 - done.slot_s / max(done.slots * span, 1e-9))))
        last_record = flow
        progress(1)
    return run


@dataclass(frozen=True)
class _Round:
    start: float
    end: float
    finished: list[SimSample]
    busy_s: float
    slot_s: float
    slots: int
    version: int
    generated: int | None = None  # tokens sampled in the round (SortedRL: resumed prefixes left out; None: all)


def mode_config(config: str | None, overrides: list[str], mode: str, seed: int, equal_steps: bool,
                config_text: str | None = None) -> ReflowConfig:
    """The config ``reflow bench`` gives row ``mode`` and ``seed`` (``flows.bench.bench_mode``; a SortedRL row is
    mode ``sync`` with its ``rollout.scheduling``). ``config_text``: the file as the bench read it (its
    bench.json's ``meta.config_text``), instead of the file as it is now."""
    kind, scheduling = mode_bench.ROWS[mode]
    rows = [f"mode.kind={json.dumps(kind)}", f"rollout.scheduling={json.dumps(scheduling)}", f"run.seed={seed}"]
    if not equal_steps:
        cfg = load_config(config, [*overrides, *rows], text=config_text)
        rows += mode_bench.equal_data(cfg.run.total_steps, cfg.rollout.prompts_per_step, cfg.fresh_groups_per_step())
    return load_config(config, [*overrides, *rows], text=config_text)


def config_path(path: str | None) -> str | None:
    """A config path as given, or under the package (a bench.json names it relative to where it ran)."""
    if path is None or Path(path).is_file():
        return path
    inside = Path(__file__).resolve().parents[1] / path
    return str(inside) if inside.is_file() else path


def simulate(cfg: ReflowConfig, profile: SimProfile, seed: int,
             progress: Callable[[int], None] = lambda n: None) -> SimRun:
    """One mode (``cfg.mode.kind``, with SortedRL rounds when ``rollout.scheduling`` says so) in virtual time;
    ``progress(n)`` after each step. The run is named by its bench row (``sorted_partial`` for sync with those
    rounds)."""
    if cfg.mode.kind not in MODES:
        raise ValueError(f"simulate: mode {cfg.mode.kind!r} is not simulated (choose from {', '.join(MODES)})")
    if cfg.rollout.scheduling != "plain" and cfg.mode.kind != "sync":
        raise ValueError(f"simulate: SortedRL rounds are simulated in mode sync only, not {cfg.mode.kind!r}")
    if cfg.resources.flex_workers and cfg.mode.kind not in STREAMING:
        raise ValueError(f"simulate: flex workers are simulated in the streaming modes only (async, reflow), not "
                         f"{cfg.mode.kind!r}")
    with _rare_collections():
        return (_streaming if cfg.mode.kind in STREAMING else _rounds)(cfg, profile, seed, progress)


@contextmanager
def _rare_collections() -> Iterator[None]:
    """Python's cycle collector less often while a simulation runs: it allocates millions of short-lived objects
    (a request, a sample, a row each) that hold no cycles, and at the default thresholds full collections,
    each scanning every live object, took 15% of a 128-GPU simulation (docs/measurements.md, 2026-12-06).
    The objects alive before it starts (the modules imported: torch's alone are millions) are frozen, so that
    the collections it still makes scan the simulation's objects only. The thresholds are restored after."""
    before = gc.get_threshold()
    gc.set_threshold(50_000, 10, 10)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
