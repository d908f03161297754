"""Time for the control plane, behind an interface.

Control-plane code never calls ``time.time()`` or ``sleep`` itself; it takes a
``Clock`` so the same code can later run in virtual time against modelled
engines and trainers.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Wall-clock time of this machine."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class VirtualClock:
    """Time that only moves when told to (tests, simulation)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
