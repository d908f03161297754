"""What the feeder and the selector loops share, guarded by one condition variable."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class LoopState:
    """What the two loops share (guarded by ``cond``)."""

    trainer_version: int = 0
    groups_submitted: int = 0  # whole groups handed to the engine
    groups_written: int = 0  # whole groups appended to the trajectories table
    groups_consumed: int = 0  # unused (fresh or stale) groups trained on
    groups_expired: int = 0  # written groups that aged out of the window unused (wasted generation)
    groups_abandoned: int = 0  # groups aborted in flight: a finished sample was already out of the window
    unused: dict[int, int] = field(default_factory=dict)  # written, not trained on: group -> oldest version
    engine_busy_s: float = 0.0  # engine time spent stepping with requests in flight (the pool's mean)
    generated_tokens: int = 0
    engine_seconds: dict[int, float] = field(default_factory=dict)  # engine index -> its own stepping seconds
    engine_tokens: dict[int, int] = field(default_factory=dict)  # engine index -> tokens it generated
    write_seconds: float = 0.0  # the feeder's appends (scoring and committing finished groups), in total
    writes: int = 0
    # The elastic pool (``control.roles``): flex worker engine index -> its role; those set to train with nothing
    # left in flight (a step may use them); switches decided and not yet done -> when decided; each done
    # switch's measured seconds
    roles: dict[int, str] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    switching: dict[int, float] = field(default_factory=dict)
    switch_seconds: list[tuple[int, str, float]] = field(default_factory=list)  # (engine, new role, seconds)
    requests_moved: int = 0  # requests a flex worker switching to training gave back, resumed on another engine
    unused_group_seconds: float = 0.0  # the level of unused groups integrated over time (the feeder samples it)
    stop: bool = False
    error: BaseException | None = None  # why a loop stopped the run
    cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def set_version(self, version: int) -> None:
        with self.cond:
            self.trainer_version = version
            self.cond.notify_all()

    def admissible_unused(self, max_staleness_versions: int) -> int:
        """Unused groups still inside the window (call with ``cond`` held); expired ones are dropped."""
        oldest_ok = self.trainer_version - max_staleness_versions
        expired = [g for g, v in self.unused.items() if v < oldest_ok]
        for g in expired:
            del self.unused[g]
        self.groups_expired += len(expired)
        return len(self.unused)

    def request_stop(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
