"""What the feeder and the selector loops share, guarded by one condition variable."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class GroupVersions(dict[int, int]):
    """Group -> its oldest version, knowing a lower bound of the versions.

    The feeder asks which groups fell out of the staleness window before
    every admission (the unused ones) and after every drain window (the
    ones in flight): a few hundred times a step at 128 GPUs, with thousands
    of groups each. The bound answers without a scan until the window's
    floor passes it, about once a step (``expire``).
    """

    least: float = math.inf  # no value is below it (removing keeps it true); here too for an unpickled one, whose
    # items are set before its attributes

    def __init__(self, items: Mapping[int, int] | Iterable[tuple[int, int]] = (), **kw: int) -> None:
        super().__init__()
        self.least = math.inf
        self.update(items, **kw)

    def __setitem__(self, group: int, version: int) -> None:
        super().__setitem__(group, version)
        self.least = min(self.least, version)

    def update(self, items: Any = (), **kw: int) -> None:  # type: ignore[override]
        for group, version in dict(items, **kw).items():
            self[group] = version

    def setdefault(self, group: int, version: int = 0) -> int:  # type: ignore[override]
        if group not in self:
            self[group] = version
        return self[group]

    def __ior__(self, items: Any) -> GroupVersions:  # type: ignore[override]
        self.update(items)
        return self

    def expire(self, oldest_ok: int) -> list[int]:
        """Drop the groups older than ``oldest_ok`` and return them (in the order they were added)."""
        if self.least >= oldest_ok:
            return []
        expired = [g for g, v in self.items() if v < oldest_ok]
        for g in expired:
            del self[g]
        self.least = min(self.values(), default=math.inf)
        return expired


@dataclass
class LoopState:
    """What the two loops share (guarded by ``cond``)."""

    trainer_version: int = 0
    groups_submitted: int = 0  # whole groups handed to the engine
    groups_written: int = 0  # whole groups appended to the trajectories table
    groups_consumed: int = 0  # unused (fresh or stale) groups trained on
    groups_expired: int = 0  # written groups that aged out of the window unused (wasted generation)
    groups_abandoned: int = 0  # groups aborted in flight: a finished sample was already out of the window
    unused: GroupVersions = field(default_factory=GroupVersions)  # written, not trained on: group -> oldest version
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

    def __post_init__(self) -> None:
        if not isinstance(self.unused, GroupVersions):
            self.unused = GroupVersions(self.unused)

    def set_version(self, version: int) -> None:
        with self.cond:
            self.trainer_version = version
            self.cond.notify_all()

    def admissible_unused(self, max_staleness_versions: int) -> int:
        """Unused groups still inside the window (call with ``cond`` held); expired ones are dropped."""
        self.groups_expired += len(self.unused.expire(self.trainer_version - max_staleness_versions))
        return len(self.unused)

    def request_stop(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
