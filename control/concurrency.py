"""The number of generation requests in flight, adapted to measured throughput (AIMD)."""

from __future__ import annotations

import math


class ConcurrencyController:
    """Additive-increase / multiplicative-decrease on measured generation throughput, judging moves only.

    A window is at least ``window_s`` engine-busy seconds in which the engine
    ran at its target (a window limited by the gate says nothing about
    concurrency and is discarded). A move of the target is judged by the
    first window after it, against the mean throughput of the windows at the
    target before it:

    * after a move up: at least ``1 + tolerance`` times that mean, the move
      helped, so ``target += increase`` again; below ``1 - tolerance``
      times, back off: ``target = max(minimum, floor(target * decrease))``
      (longer responses made each step slower than the extra sequences are
      worth, or memory pressure preempts requests); otherwise hold;
    * after a back-off: below ``1 - tolerance`` times, the back-off hurt, so
      ``target += increase``; otherwise hold.

    Windows at an unchanged target judge nothing: they only measure it. Its
    throughput moves with things the target does not cause (the responses
    in flight, weight loads, other processes on the cores), and a rule that
    compared each window with the one before backed off on that noise: in a
    2026-12-02 bench run the reflow engine (more weight loads) averaged 108
    sequences and async's 147, where more sequences always decode faster on
    that CPU. After ``patience`` windows at one target the controller probes
    upward (response lengths drift during RL, so the best setting moves);
    the first window of a run is such a probe. ``target`` stays in
    ``[minimum, maximum]``. Every decision is kept so the caller can log it.
    """

    def __init__(self, initial: int, minimum: int, maximum: int, increase: int, decrease: float = 0.75,
                 tolerance: float = 0.05, window_s: float = 2.0, patience: int = 3) -> None:
        if not 1 <= minimum <= initial <= maximum:
            raise ValueError(f"need 1 <= minimum ({minimum}) <= initial ({initial}) <= maximum ({maximum})")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {decrease}")
        self.target, self.minimum, self.maximum = initial, minimum, maximum
        self.increase, self.decrease, self.tolerance = increase, decrease, tolerance
        self.window_s, self.patience = window_s, patience
        self._tokens = 0
        self._seconds = 0.0
        self._saturated = True
        self._level: list[float] = []  # throughput of the windows at the current target
        self._judge: tuple[float, int] | None = None  # (mean throughput before the last move, its direction)
        self._started = False
        self.decisions: list[tuple[int, float, str]] = []  # (target after, throughput, reason)

    def observe(self, tokens: int, busy_s: float, saturated: bool) -> int:
        """Account one drain window; returns the (possibly new) target."""
        self._tokens += tokens
        self._seconds += busy_s
        self._saturated &= saturated
        if self._seconds < self.window_s:
            return self.target
        throughput = self._tokens / self._seconds
        usable = self._saturated
        self._tokens, self._seconds, self._saturated = 0, 0.0, True
        if not usable:
            return self.target
        reason = self._decide(throughput)
        before = sum(self._level) / len(self._level) if self._level else throughput
        moved = self.target
        if reason in ("increase", "probe"):
            self.target = min(self.maximum, self.target + self.increase)
        elif reason == "decrease":
            self.target = max(self.minimum, int(math.floor(self.target * self.decrease)))
        if self.target != moved:
            self._judge, self._level = (before, 1 if self.target > moved else -1), []
        elif reason == "probe":  # at the maximum: nothing to probe, measure afresh
            self._level = []
        self.decisions.append((self.target, throughput, reason))
        return self.target

    def _decide(self, throughput: float) -> str:
        """The reason of this window's decision; records the window at the target it measured."""
        judge, self._judge = self._judge, None
        self._level.append(throughput)
        if not self._started:
            self._started = True
            return "probe"
        if judge is None:  # an unchanged target: measured, not judged
            return "probe" if len(self._level) >= self.patience else "hold"
        before, direction = judge
        if direction > 0 and throughput >= before * (1 + self.tolerance):
            return "increase"
        if throughput < before * (1 - self.tolerance):
            return "decrease" if direction > 0 else "increase"
        return "hold"
