"""The Ray actors that host a run's engines and its trainer.

Actors are named inside a per-run Ray namespace (``infra.placement`` starts
them), so Prefect tasks find them by name (a reference) instead of receiving
clients. Weights travel from the trainer to the engines through Ray's object
store, never through the driver. Both restore their state when Ray restarts
them after their process died.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
import torch
from safetensors.torch import load_file, safe_open, save_file

from reflow.config.schema import ReflowConfig
from reflow.infra.run import latest_checkpoint
from reflow.policies.batch import train_samples_from_table
from reflow.policies.engines import Engine, EngineSettings
from reflow.policies.hf_engine import TransformersEngine
from reflow.policies.models import load_tokenizer
from reflow.policies.multiturn import MultiTurnEngine, ToolSettings
from reflow.policies.rounds import SlotMeter, run_round
from reflow.policies.trainer import GradientShare, Trainer, TrainSample, split_by_tokens
from reflow.policies.vllm_engine import VLLMEngine
from reflow.policies.weight_sync import Backend, TensorSpec, WeightGroup, tensor_specs
from reflow.storage import queries
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.metrics import BatchStats, TrainStep
from reflow.storage.recent import RecentTrajectories
from reflow.storage.schema import Drain, GenBatch


def _restarted() -> bool:
    """Whether this actor is a restart by Ray of one that died (its state is gone)."""
    if not ray.is_initialized():  # a class used directly (unit tests): get_runtime_context() would start a Ray
        return False
    try:
        return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # not inside an actor (unit tests call the classes directly)
        return False


class EngineWorker:
    """Hosts one generation ``Engine`` in its own process.

    Ray restarts it when its process dies (``max_restarts``) and re-issues the
    calls that were in flight (``max_task_retries``); a restarted engine first
    loads the trainer's current weights, so it does not generate with the
    initial ones. Each start has its own ``incarnation``: callers that
    submitted requests to an earlier one re-submit those still unfinished.

    With ``tools`` (``policies.multiturn.ToolSettings``) and ``tool_fn`` (what one
    tool call runs, e.g. ``envs.tools.run_tool_call``) the engine is wrapped in
    a ``MultiTurnEngine``: tool calls run as Ray tasks while generation goes on.
    """

    def __init__(self, kind: str, settings: Any, version: int = 0, trainer: str | None = None,
                 tools: Any = None, tool_fn: Any = None) -> None:
        torch.set_num_threads(settings.threads)
        self._incarnation = uuid.uuid4().hex
        if trainer is not None and _restarted():
            weights, version = ray.get(ray.get_actor(trainer).weights_and_version.remote())
            self.engine = make_engine(kind, settings, version)
            self.engine.update_weights(weights, version)
        else:
            self.engine = make_engine(kind, settings, version)
        if settings.warm_up and hasattr(self.engine, "warm_up"):  # vLLM only: the transformers engine has none
            self.engine.warm_up()
        if tools is not None:
            self.engine = _multi_turn(self.engine, settings.model_dir, tools, tool_fn)
        self.max_sequences = settings.max_concurrent_sequences

    def generate(self, requests: Sequence[Any]) -> Any:
        """All ``requests`` to completion, as a ``GenBatch`` (results, engine seconds, slot-time)."""
        start = time.perf_counter()  # engine-side busy time, reported to the control plane
        if self.engine.num_unfinished():  # parked by a sorted round (``run_round``): not to be run on these weights
            self.engine.abort(self.engine.pending_ids())  # (the rollout cache has them; they resume by prefill)
        meter = SlotMeter(self.engine, self.max_sequences)
        self.engine.submit(requests)
        results = []
        while self.engine.num_unfinished():
            results.extend(meter.collect(max_steps=4))
        return GenBatch(results=results, seconds=time.perf_counter() - start,
                        busy_slot_seconds=meter.busy_slot_seconds, slots=min(len(requests), self.max_sequences))

    def submit(self, requests: Sequence[Any]) -> int:
        """Queue ``requests`` in the running engine (streaming modes); returns the number in flight.

        Requests already running are skipped: after a restart both Ray's retry
        of a queued ``submit`` and the caller's re-submission may bring them.
        """
        running = set(self.engine.pending_ids())
        self.engine.submit([r for r in requests if r.request_id not in running])
        return self.engine.num_unfinished()

    def drain(self, window_s: float, release: bool = False) -> Any:
        """Step the engine for about ``window_s`` seconds; a ``Drain`` of what finished meanwhile.

        ``release``: first abort every request that can resume elsewhere (a
        multi-turn request waiting on its tool stays) and return what each
        had generated in ``released`` (a flex worker moving to training).
        """
        released = []
        if release:
            released = self.engine.abort(getattr(self.engine, "movable_ids", self.engine.pending_ids)())
        start = time.perf_counter()
        meter = SlotMeter(self.engine, self.max_sequences)
        results = []
        while self.engine.num_unfinished() and time.perf_counter() - start < window_s:
            results.extend(meter.collect(max_steps=2))
        return Drain(results=results, seconds=time.perf_counter() - start, in_flight=self.engine.num_unfinished(),
                     busy_slot_seconds=meter.busy_slot_seconds, incarnation=self._incarnation, released=released)

    def run_round(self, queue: Sequence[Any], rule: Any) -> Any:
        """One length-aware round in one call (``policies.engines.run_round``): a ``RoundRun``.

        The engine stays full from ``queue`` until ``rule`` is met, then the
        rest is aborted, or with ``rule.park`` left running for the next
        round (the rollout cache holds its tokens either way). Ray's retry of
        the call on a restarted actor runs the round again: the new engine
        holds nothing, so parked requests resume by prefill.
        """
        return run_round(self.engine, queue, rule, self.max_sequences, park=getattr(rule, "park", False))

    def abort(self, request_ids: Sequence[str] | None = None) -> list[Any]:
        """Abort the named requests (all in flight when None); their partial results."""
        return self.engine.abort(self.engine.pending_ids() if request_ids is None else request_ids)

    def update_weights(self, state: dict[str, Any], version: int) -> int:
        """Load new weights in place; requests in flight continue with them."""
        self.engine.update_weights(state, version)
        return version

    def join_weight_group(self, address: str, rank: int, world: int, backend: Backend,
                          specs: Sequence[TensorSpec]) -> int:
        """Become rank ``rank`` of the weight broadcast group (``resources.weight_sync = "broadcast"``)."""
        self._weight_group = WeightGroup(address, rank, world, backend)
        self._weight_specs = list(specs)
        return rank

    def receive_weights(self, version: int) -> int:
        """Take the weights the trainer broadcasts now and load them in place (as ``update_weights``)."""
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("this engine is not in the weight broadcast group (restarted by Ray? a group cannot "
                               "take a new member: resume the run)")
        self.engine.update_weights(group.receive(self._weight_specs), version)
        return version

    def version(self) -> int:
        return self.engine.version

    def incarnation(self) -> str:
        """Which start of this actor answers (changes when Ray restarts it)."""
        return self._incarnation

    def pid(self) -> int:
        return os.getpid()


class FlexWorker(EngineWorker):
    """A worker of the elastic pool: an engine that can also compute a share of the trainer's step.

    It holds the model twice in one process: the engine's copy (generating)
    and a trainer module without optimiser state of its own (``Trainer``:
    its AdamW never steps). Both are built once, at start, so a switch of role
    loads nothing from disk: to train it only stops receiving new requests
    (those in flight finish, keeping their per-token versions) and, at its
    first share, loads the trainer's current weights from the object store;
    to generate it takes requests again (its engine received every weight push
    meanwhile). Which role it plays is the scheduler's (``control.roles``), not
    the actor's: it answers whatever call comes, one at a time.

    On a GPU its vLLM engine starts with sleep mode and a share of the GPU
    (``pool.gpu_memory_utilization``); before the first share of a training
    spell the engine sleeps (``VLLMEngine.rest``: weights to host memory, KV
    cache freed, so the trainer module has the memory), and the next requests
    wake it, with the newest weights pushed meanwhile.
    """

    def __init__(self, kind: str, settings: Any, model_dir: str, config_json: str, version: int = 0,
                 trainer: str | None = None, tools: Any = None, tool_fn: Any = None) -> None:
        super().__init__(kind, settings, version, trainer, tools, tool_fn)
        cfg = ReflowConfig.model_validate_json(config_json)
        self.learner = Trainer(model_dir, cfg.train, cfg.run.seed, device=train_device(cfg), dtype=cfg.model.dtype)
        if cfg.train.warm_up:
            self.learner.warm_up(warm_up_tokens(cfg))
        self.shares = 0  # gradient shares computed
        self.weight_loads = 0
        self.rests = 0  # training spells its engine slept through (GPU only)

    def gradients(self, samples: list[TrainSample], normaliser: float, weights_id: int,
                  weights: list[Any]) -> GradientShare:
        """Forward and backward on ``samples`` under the trainer's weights ``weights_id``; ``weights`` holds one
        reference to them (in a list, so Ray fetches them only when this worker lacks them)."""
        start = time.perf_counter()
        if self.engine.rest():
            self.rests += 1
        loaded = self.learner.weights_id != weights_id
        if loaded:
            self.learner.load_weights(ray.get(weights[0]), weights_id)
            self.weight_loads += 1
        share = self.learner.gradients(samples, normaliser)
        self.shares += 1
        return dataclasses.replace(share, seconds=time.perf_counter() - start, loaded_weights=loaded)

    def counters(self) -> dict[str, int]:
        return {"shares": self.shares, "weight_loads": self.weight_loads, "rests": self.rests}


class _SharedWeights:
    """The trainer's weights in the object store, put once per ``weights_id`` for every helper of a step."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.ref: tuple[int, Any] | None = None

    def get(self, weights_id: int) -> Any:
        if self.ref is None or self.ref[0] != weights_id:
            self.ref = (weights_id, ray.put(self.trainer.export_weights()))
        return self.ref[1]


@dataclass
class RayGradientHelper:
    """``policies.trainer.GradientHelper`` over a ``FlexWorker`` actor."""

    worker: Any
    weights: _SharedWeights

    def start(self, samples: list[TrainSample], normaliser: float, weights_id: int) -> Any:
        return self.worker.gradients.remote(samples, normaliser, weights_id, [self.weights.get(weights_id)])

    def collect(self, handle: Any) -> GradientShare:
        return ray.get(handle)


class RayToolRunner:
    """Each call is a Ray task (``cpus_per_call`` CPUs) running ``fn(transcript, timeout_s, max_chars)``.

    At most ``max_concurrent_calls`` tasks run at once (the rest queue here),
    so a burst of calls does not start a worker process per call.
    """

    def __init__(self, fn: Callable[[str, float, int], str], settings: ToolSettings) -> None:
        self._remote = ray.remote(fn).options(num_cpus=settings.cpus_per_call, max_retries=1)
        self.settings = settings
        self._queue: deque[tuple[str, str]] = deque()
        self._running: dict[Any, str] = {}  # object ref -> key

    def start(self, key: str, transcript: str) -> None:
        self._queue.append((key, transcript))
        self._launch()

    def _launch(self) -> None:
        while self._queue and len(self._running) < self.settings.max_concurrent_calls:
            key, transcript = self._queue.popleft()
            ref = self._remote.remote(transcript, self.settings.timeout_s, self.settings.max_output_chars)
            self._running[ref] = key

    def ready(self, timeout_s: float) -> list[tuple[str, str]]:
        if not self._running:
            return []
        # Returns when all are done or after the timeout, with those done by then.
        done, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=timeout_s)
        out = [(self._running.pop(ref), ray.get(ref)) for ref in done]
        self._launch()
        return out

    def pending(self) -> int:
        return len(self._queue) + len(self._running)


def make_engine(kind: str, settings: EngineSettings, version: int = 0) -> Engine:
    """The engine ``rollout.engine`` names; vLLM errors name the missing package."""
    if kind == "vllm":
        try:
            import vllm  # noqa: F401 - only to say which extra to install
        except ImportError as exc:
            raise RuntimeError("rollout.engine='vllm' but vLLM is not installed; install the 'cpu' or "
                               "'gpu' extra, or set rollout.engine='transformers'") from exc
        return VLLMEngine(settings, version)
    if kind == "transformers":
        return TransformersEngine(settings, version, device="cuda" if torch.cuda.is_available() else "cpu")
    raise ValueError(f"unknown rollout.engine {kind!r}")


def _multi_turn(engine: Engine, model_dir: str, tools: ToolSettings, tool_fn: Any) -> MultiTurnEngine:
    tok = load_tokenizer(model_dir)
    return MultiTurnEngine(engine, tools, RayToolRunner(tool_fn, tools),
                           encode=lambda text: tok(text, add_special_tokens=False)["input_ids"],
                           decode=lambda ids: tok.decode(ids, skip_special_tokens=False))


@dataclass
class _Prefetch:
    """A batch ``TrainerWorker.prefetch`` reads: ``read`` is set (None if it failed) before ``done``."""

    key: tuple  # run id, trajectory ids, loss weights, versions: what the ``train`` call must match
    done: threading.Event = field(default_factory=threading.Event)
    read: Any = None  # (rows, samples)


class TrainerWorker:
    """Hosts the ``Trainer``; reads its batches from the trajectory store itself.

    Ray restarts it when its process dies; a restarted trainer loads the
    run's newest checkpoint and replays the steps the ``usage`` log records
    after it (same trajectories, same loss weights), then Ray re-issues the
    call that was in flight.
    """

    def __init__(self, model_dir: str, config_json: str, store_root: str, threads: int,
                 run_dir: str | None = None, run_id: str | None = None, placement_group: Any = None) -> None:
        torch.set_num_threads(threads)
        cfg = ReflowConfig.model_validate_json(config_json)
        device = train_device(cfg)
        self.store_root = store_root
        self.store = None
        self.recent = None
        # Sharded (``resources.trainer_ranks`` > 1): this actor is rank 0; it starts the other ranks in the
        # placement group's next bundles, and all join the group as they start (each waits for the rest).
        self.peers: list[Any] = []
        ranks = cfg.resources.trainer_ranks
        if ranks > 1:
            master = f"{ray.util.get_node_ip_address()}:{_free_port()}"
            res = cfg.resources
            self.peers = [ray.remote(TrainerRank).options(
                num_cpus=res.trainer_cpus, num_gpus=res.trainer_gpus, max_restarts=0,
                scheduling_strategy=in_bundle(placement_group, rank)).remote(
                    model_dir, config_json, threads, rank, master) for rank in range(1, ranks)]
            join_trainer_group(0, ranks, master, device)
        self.trainer = Trainer(model_dir, cfg.train, cfg.run.seed, device=device, dtype=cfg.model.dtype)
        self.max_staleness = cfg.buffer.max_staleness_versions  # no later batch reads below version - this
        self.replayed: dict[int, Any] = {}  # version a step started at -> its result, for steps replayed by recover
        self._prefetch_lock = threading.Lock()
        self._prefetched: _Prefetch | None = None  # the last batch ``prefetch`` was asked to read
        self.prefetch_hits = 0  # steps whose batch ``prefetch`` had read
        # Before ``launch_workers`` returns, so off the run's clock; lengths up to the longest response plus an
        # arith prompt (a longer prompt's shapes take what more memory they need at their first step).
        if cfg.train.warm_up:
            self.trainer.warm_up(warm_up_tokens(cfg))  # the other ranks warm up as they start
        if self.peers:
            ray.get([peer.version.remote() for peer in self.peers])  # each has joined and warmed up
        if run_dir is not None and run_id is not None and _restarted():
            self.recover(run_dir, run_id)

    def _on_every_rank(self, method: str, *args: Any) -> Any:
        """``self.trainer.<method>(*args)`` here and on every other rank at once (a collective); rank 0's result."""
        refs = [getattr(peer, method).remote(*args) for peer in self.peers]
        out = getattr(self.trainer, method)(*args)
        if refs:  # ray.get([]) outside Ray would start one (a one-rank worker used directly, as in unit tests)
            ray.get(refs)
        return out

    def recover(self, run_dir: str, run_id: str) -> int:
        """Newest checkpoint of ``run_dir``, then every later step of the usage log; returns the version."""
        found = latest_checkpoint(run_dir)
        done = -1
        if found is not None:
            done = found[0]
            self.trainer.load_checkpoint(found[1])
        for batch in queries.recorded_batches_after(DeltaTrajectoryStore(self.store_root), run_id, done):
            version = self.trainer.version
            self.replayed[version] = self.train(run_id, list(batch), list(batch.values()))
        return self.trainer.version

    def train(self, run_id: str, trajectory_ids: list[str], loss_weights: list[float],
              versions: tuple[int, int] | None = None, expect_version: int | None = None,
              helpers: Sequence[str] = ()) -> TrainStep:
        """One step on the named trajectories (advantages computed per whole GRPO group).

        ``versions`` (lowest, highest policy version of the batch) lets the
        read skip every other partition of the table, and lets it come from
        the files already read (``storage.recent``: only new files are read).
        ``expect_version``: the version the step must start at. A step that
        ``recover`` already replayed from the usage log (Ray re-issues the
        call a dead trainer was running) returns that result instead of
        training twice; any other mismatch is an error.
        """
        if expect_version is not None and expect_version != self.trainer.version:
            if expect_version in self.replayed:
                return self.replayed[expect_version]
            raise RuntimeError(f"trainer: a step for version {expect_version} reached the trainer at version "
                               f"{self.trainer.version}")
        start = time.perf_counter()
        read = self._take_prefetched((run_id, tuple(trajectory_ids), tuple(loss_weights), versions))
        prefetched = read is not None
        if read is None:
            read = self._read(run_id, trajectory_ids, loss_weights, versions)
        self.prefetch_hits += prefetched
        table, samples = read
        read_s = time.perf_counter() - start
        if self.peers:  # each rank steps on its token-balanced share
            shares = split_by_tokens([len(s.prompt_tokens) + len(s.response_tokens) for s in samples],
                                     1 + len(self.peers))
            refs = [peer.step.remote([samples[i] for i in share]) for peer, share in zip(self.peers, shares[1:])]
            step = self.trainer.step([samples[i] for i in shares[0]])
            ray.get(refs)
        else:
            shared = _SharedWeights(self.trainer)
            step = self.trainer.step(samples, [RayGradientHelper(ray.get_actor(name), shared) for name in helpers])
        batch = BatchStats.of(table.column("reward").to_pylist(), table.column("correct").to_pylist(),
                              table.column("response_length").to_pylist())
        return dataclasses.replace(step, trainer_read_seconds=read_s, trainer_batch_prefetched=prefetched, batch=batch)

    def prefetch(self, run_id: str, trajectory_ids: list[str], loss_weights: list[float],
                 versions: tuple[int, int] | None) -> None:
        """Read the batch of the next ``train`` call while the step before computes.

        Called in the actor's ``read`` concurrency group (``launch_workers``),
        so it runs beside a ``train`` call. The ``train`` call with the same
        batch takes the rows and samples read here (waiting for them if the
        read is still going); any other batch is read by ``train`` itself.
        A failed read is left to ``train``, which reads again and reports it.
        """
        entry = _Prefetch((run_id, tuple(trajectory_ids), tuple(loss_weights), versions))
        with self._prefetch_lock:
            self._prefetched = entry
        try:
            entry.read = self._read(run_id, trajectory_ids, loss_weights, versions)
        except Exception:  # noqa: BLE001 - train reads again and raises it there
            entry.read = None
        entry.done.set()

    def _take_prefetched(self, key: tuple) -> Any | None:
        """What ``prefetch`` read for ``key`` (waiting for a read under way); None: not prefetched."""
        with self._prefetch_lock:
            entry, self._prefetched = self._prefetched, None
        if entry is None or entry.key != key:
            return None
        entry.done.wait()
        return entry.read

    def _read(self, run_id: str, trajectory_ids: list[str], loss_weights: list[float],
              versions: tuple[int, int] | None) -> tuple[Any, list]:
        """The batch's rows and its ``TrainSample`` list (advantages computed per whole GRPO group)."""
        with self._prefetch_lock:
            if self.store is None:
                self.store = DeltaTrajectoryStore(self.store_root)  # kept open: later reads see only new commits
                self.recent = RecentTrajectories(self.store)
                self.recent.keep_fresh()  # new files are read as they are committed, from the first read on
        if versions is None:
            table = self.store.read_trajectories(run_id=run_id, ids=trajectory_ids)
        else:
            table = self.recent.read(run_id, trajectory_ids, versions,
                                     keep_from=self.trainer.version - self.max_staleness)
        if table.num_rows != len(set(trajectory_ids)):
            raise RuntimeError(f"trainer: {len(set(trajectory_ids))} trajectories selected, "
                               f"{table.num_rows} found in {self.store_root}")
        return table, train_samples_from_table(table, dict(zip(trajectory_ids, loss_weights)), self.trainer.cfg)

    def export_weights(self) -> dict[str, Any]:
        return self._on_every_rank("export_weights")

    def weight_group_address(self) -> str:
        """Where this trainer serves the weight broadcast group: its node's address and a free port."""
        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def weight_specs(self) -> list[TensorSpec]:
        """Names, dtypes and shapes of the weights as ``broadcast_weights`` sends them."""
        return tensor_specs(self.trainer.model.state_dict())

    def join_weight_group(self, address: str, world: int, backend: Backend) -> int:
        """Serve and join the weight broadcast group as its rank 0 (the engines are ranks 1 ...)."""
        self._weight_group = WeightGroup(address, 0, world, backend)
        return 0

    def broadcast_weights(self, weights: dict[str, Any], version: int) -> tuple[int, float]:
        """Broadcast ``weights`` (``export_weights``' copy of ``version``, passed by reference) to every engine;
        (bytes sent to each, seconds). Called in the "sync" concurrency group, so a streaming step's training
        goes on while the engines take the last version's weights."""
        started = time.perf_counter()
        sent = self._weight_group.send(weights)
        return sent, time.perf_counter() - started

    def version(self) -> int:
        return self.trainer.version

    def weights_and_version(self) -> tuple[dict[str, Any], int]:
        """The current weights and their version, consistent with each other."""
        return self._on_every_rank("export_weights"), self.trainer.version

    def pid(self) -> int:
        return os.getpid()

    def weight_bytes(self) -> int:
        """Bytes of one full copy of the weights (what ``export_weights`` returns)."""
        return sum(p.numel() * p.element_size() for p in self.trainer.model.state_dict().values())

    def ranks(self) -> list[tuple[int, str]]:
        """(pid, Ray node id) of each trainer rank, rank 0 first."""
        here = (os.getpid(), ray.get_runtime_context().get_node_id())
        return [here, *ray.get([peer.where.remote() for peer in self.peers])]

    def save_checkpoint(self, path: str) -> str:
        return str(self._on_every_rank("save_checkpoint", path))

    def load_checkpoint(self, path: str) -> int:
        return self._on_every_rank("load_checkpoint", path)

    def save_hf(self, path: str) -> str:
        return str(self._on_every_rank("save_hf", path))


class TrainerRank:
    """Rank ``rank`` >= 1 of a sharded trainer: its shard of the weights and of the optimiser state.

    The ``TrainerWorker`` (rank 0) starts it and calls it for every
    collective (a step on its share, a weight gather, a checkpoint). Not
    restarted by Ray: a process group cannot take a new member, so a dead
    rank fails the run and ``reflow resume`` continues it.
    """

    def __init__(self, model_dir: str, config_json: str, threads: int, rank: int, master: str) -> None:
        torch.set_num_threads(threads)
        cfg = ReflowConfig.model_validate_json(config_json)
        device = train_device(cfg)
        join_trainer_group(rank, cfg.resources.trainer_ranks, master, device)
        self.trainer = Trainer(model_dir, cfg.train, cfg.run.seed, device=device, dtype=cfg.model.dtype)
        if cfg.train.warm_up:
            self.trainer.warm_up(warm_up_tokens(cfg))

    def step(self, samples: list[Any]) -> TrainStep:
        return self.trainer.step(samples)

    def export_weights(self) -> None:
        self.trainer.export_weights()  # its part of the gather; rank 0 keeps the copy

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> int:
        return self.trainer.load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        self.trainer.save_hf(path)

    def version(self) -> int:
        return self.trainer.version

    def where(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()


def train_device(cfg: ReflowConfig) -> str:
    """``train.device``, with ``auto`` resolved on this process's host."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


def warm_up_tokens(cfg: ReflowConfig) -> int:
    """Sequence length the trainer warms up to: the longest response plus an arith prompt."""
    return cfg.rollout.max_response_tokens + 64


def join_trainer_group(rank: int, world: int, master: str, device: str) -> None:
    """Join the trainer ranks' ``torch.distributed`` group (NCCL on GPUs, gloo on CPU) at ``master`` (host:port)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
    torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                         init_method=f"tcp://{master}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(minutes=10))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def in_bundle(placement_group: Any, index: int) -> Any:
    """Scheduling in bundle ``index`` of ``placement_group`` (None: Ray's default scheduling)."""
    if placement_group is None:
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=placement_group, placement_group_bundle_index=index)


def write_weights(weights: dict[str, Any], path: str, version: int) -> str:
    """Save ``weights`` (a state dict) with their ``version`` to ``path`` atomically (a Ray task's body)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp, metadata={"version": str(version)})
    os.replace(tmp, path)
    return path


def read_weights(path: str) -> tuple[dict[str, Any], int]:
    """The state dict and version ``write_weights`` saved (a Ray task's body)."""
    with safe_open(path, framework="pt") as f:
        version = int(f.metadata()["version"])
    return load_file(path), version
