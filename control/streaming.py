"""The streaming modes wired: a feeder loop and a selector loop at once over one shared state.

``async`` and ``reflow`` run two loops at once over one shared ``LoopState``:

* **Feeder** (generators -> score -> buffer): keeps the engine filled with
  whole GRPO groups up to the concurrency target, steps it in short drain
  windows, and appends each group to the ``trajectories`` table as soon as
  all its samples are finished. Scoring and writing the previous window
  overlap the engine's next window.
* **Selector** (buffer -> batch -> trainer -> weights -> generators): asks the
  buffer for a batch (one SQL query, ``storage.replay.select_batch``), trains
  on it, and pushes the new weights to the engine without waiting: the
  engine applies them between two drain windows, so the feeder stops only for
  the load itself, and requests in flight continue with the new weights
  (every token keeps the version that sampled it).

Back-pressure (``control.gate``): the feeder keeps at most
``max(max_staleness_versions, 1) * groups_per_step`` groups *ahead* of the
trainer (and at least one full batch): in flight, or written and not yet
trained on while still young enough to be admissible. This is AReaL's rule
for ``max_head_offpolicyness`` (``submitted <= (trainer_version +
max_staleness_versions + 1) * groups_per_step``) with one version of slack:
a group's version is its oldest token's, and the engine loads new weights a
moment after the trainer makes them, so a group admitted at trainer version
``t`` may start at ``t - 1``; without the slack a steady share of groups
would age out unused. Counting only admissible groups also covers groups
that do age out (they would otherwise hold the gate shut forever), and the
one-batch floor means a closed gate with nothing in flight always leaves a
full batch of unused groups waiting (no deadlock). The bound itself is
enforced by the selection query, which never returns a row older than
``trainer_version - max_staleness_versions``.

Selection rule per mode (``SelectorLoop.batch_ready``):

* ``async``: a full batch of ``groups_per_step`` unused groups (no replay);
  the trainer waits for them otherwise.
* ``reflow``: a full batch in which replayed groups fill what fresh data
  lacks, up to ``replay_ratio`` of the samples; so the trainer waits only
  while fresh data is below ``1 - replay_ratio`` of a batch. The first batch
  of a run, with nothing yet to replay, is that minimum share of unused
  groups alone.

The loops (``control.feeder``, ``control.selector``) are plain Python against
two small backends and a ``Clock``; ``StreamingLoops`` sizes them from the
config and runs them. The Prefect flow provides backends made of tasks and Ray
actors (``tasks.stream``), the tests in-process ones (and drive
``run_once``/``try_step`` in any order), the simulator modelled ones.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field

from reflow.config.schema import ReflowConfig
from reflow.control.clock import Clock
from reflow.control.concurrency import ConcurrencyController
from reflow.control.feeder import FeederBackend, FeederLoop
from reflow.control.gate import StalenessGate
from reflow.control.roles import RolePool, RoleScheduler
from reflow.control.selector import SelectorBackend, SelectorLoop
from reflow.control.state import LoopState


@dataclass(frozen=True)
class StreamStart:
    """Where the feeder continues: the start of the stream, or after what a killed attempt wrote."""

    next_group: int = 0  # first stream position not written yet (groups in flight then are skipped)
    next_chunk: int = 0  # next write transaction
    written_groups: int = 0
    unused: dict[int, int] = field(default_factory=dict)  # written groups never trained on -> oldest version


def concurrency_controller(cfg: ReflowConfig) -> ConcurrencyController:
    """The in-flight request target of one engine (``concurrency``; its maximum
    ``rollout.max_concurrent_sequences``)."""
    c = cfg.concurrency
    initial = c.initial_sequences
    maximum = cfg.rollout.max_concurrent_sequences if c.adaptive else initial
    minimum = c.min_sequences if c.adaptive else initial
    return ConcurrencyController(initial, minimum, maximum, c.increase, c.decrease, window_s=c.window_s)


def role_pool(cfg: ReflowConfig, state: LoopState, clock: Clock) -> RolePool:
    """The flex workers' scheduler (``[pool]``) over ``state``; every worker starts in ``pool.initial_role``."""
    p, flex = cfg.pool, list(cfg.resources.flex_indices)
    scheduler = RoleScheduler([p.initial_role] * len(flex), clock, low=p.low_batches, high=p.high_batches,
                              dwell_s=p.dwell_s, policy=p.policy, max_moves=p.max_moves,
                              fixed_generators=cfg.resources.engines, fixed_trainers=cfg.resources.trainer_ranks)
    return RolePool(scheduler, state, flex, cfg.rollout.prompts_per_step, p.window_s, p.switch_estimate_s)


class StreamingLoops:
    """The feeder and the selector of one ``async`` or ``reflow`` run, sized from its config.

    ``state`` and ``controllers`` (one per engine) exist from the start, so the backends can be
    built around them; ``run`` then runs the feeder in a thread (carrying the
    caller's ``contextvars``, so a framework's run context reaches its calls)
    and the selector in the calling thread, until ``steps`` are trained or
    ``run.max_new_groups`` is spent, and stops the feeder.
    """

    def __init__(self, cfg: ReflowConfig, clock: Clock, engines: int, first_step: int = 0,
                 start: StreamStart = StreamStart(), new_groups: int = 0) -> None:
        self.cfg, self.clock, self.first_step, self.start, self.new_groups = cfg, clock, first_step, start, new_groups
        self.replay = cfg.mode.kind == "reflow"
        # one update per step: a restored trainer's version is the number of steps done
        self.state = LoopState(trainer_version=first_step, groups_submitted=start.next_group,
                               groups_written=start.written_groups, unused=dict(start.unused))
        self.controllers = [concurrency_controller(cfg) for _ in range(engines)]
        self.selector: SelectorLoop | None = None
        self.pool = role_pool(cfg, self.state, clock) if cfg.resources.flex_workers else None

    def last_step(self) -> int:
        """The run's last step: ``run.total_steps - 1``, or the one that spent ``run.max_new_groups``."""
        final = self.selector.final_step if self.selector is not None else None
        return final if final is not None else self.cfg.run.total_steps - 1

    def running(self) -> bool:
        """Whether the loops still run (a backend stops chaining work once this is False)."""
        return not self.state.stop

    def feeder(self, backend: FeederBackend) -> FeederLoop:
        """The feeder over ``backend``.

        The gate counts whole batches in both modes: reflow trains on fresh
        groups first, so it consumes a full batch of them whenever they are
        there, and a gate sized by its minimum fresh share starves the
        engine. Appends of a quarter batch (or one a second) in both modes:
        each is a task run and a Delta commit on the control plane's CPU,
        which the engine shares. Sized by reflow's fresh share (a quarter of
        16 groups), reflow appended 4.8 groups at a time; now 6.4, async 6.7
        (2026-12-02, configs/bench.toml).
        """
        b, groups = self.cfg.buffer, self.cfg.rollout.prompts_per_step
        loop = FeederLoop(backend, self.state, StalenessGate(b.max_staleness_versions, groups, groups),
                          self.controllers, self.clock, window_s=b.drain_window_s,
                          write_min_groups=max(1, groups // 4),
                          batch_unused_groups=self.cfg.fresh_groups_per_step(),
                          move_on_switch=self.cfg.pool.in_flight == "move")
        loop.resume_at(self.start.next_group, self.start.next_chunk)
        return loop

    def selector_loop(self, backend: SelectorBackend) -> SelectorLoop:
        """The selector over ``backend`` (reflow selects ahead unless the staleness bound is 0)."""
        b = self.cfg.buffer
        return SelectorLoop(backend, self.state, self.cfg.rollout.prompts_per_step, self.clock,
                            min_unused_groups=self.cfg.fresh_groups_per_step(),
                            select_ahead=self.replay and b.select_ahead and b.max_staleness_versions > 0,
                            max_new_groups=self.cfg.run.max_new_groups, new_groups=self.new_groups,
                            pool=self.pool)

    def run(self, feeder_backend: FeederBackend, selector_backend: SelectorBackend) -> None:
        """Train steps ``first_step .. run.total_steps - 1`` (or until the budget is spent); raise what stopped
        the feeder."""
        feeder = self.feeder(feeder_backend)
        self.selector = self.selector_loop(selector_backend)
        thread = threading.Thread(target=contextvars.copy_context().run, args=(feeder.run,), name="feeder",
                                  daemon=True)
        thread.start()
        try:
            self.selector.run(range(self.first_step, self.cfg.run.total_steps))
        finally:
            self.state.request_stop()
            thread.join()
        if self.state.error is not None:
            raise RuntimeError("the feeder loop failed") from self.state.error
