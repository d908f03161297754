"""Driving an engine through a length-aware round (``run_round``) and measuring its slot time (``SlotMeter``).

Runs where the engine lives (inside the engine actor); ``control.sorted_rounds``
plans the rounds and reads their ``RoundRun``.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from reflow.policies.engines import Engine
from reflow.storage.schema import GenRequest, GenResult, RoundRun


class StopRule(Protocol):
    """When a round may end; told about every finished sample as it finishes (``control.sorted_rounds.RoundGoal``)."""

    def observe(self, result: GenResult) -> None: ...

    def met(self) -> bool: ...


def run_round(engine: Engine, queue: Sequence[GenRequest], rule: StopRule, max_sequences: int,
              park: bool = False) -> RoundRun:
    """Generate from ``queue`` until ``rule`` is met (or nothing is left), then abort what still runs.

    The engine is kept at ``max_sequences`` running requests: before every
    step it takes requests from the front of ``queue`` into the slots that
    came free, so it never idles while work waits, and a request that was
    never needed is never added (nor aborted). Runs where the engine lives,
    one call per round: the engine steps back to back, with no caller round
    trip between steps, and stops in the step that meets the rule.

    ``park`` (an engine with ``snapshot``, i.e. vLLM, with
    ``rollout.kv_on_update = "keep"``): what still runs at the end is not
    aborted but left in the engine, with its KV cache, and reported as
    aborted (tokens so far, for the rollout cache). The next
    round finds those requests in its queue (same ids, resumed from exactly
    those tokens) still running and lets them go on instead of prefilling
    them again (``RoundRun.continued``). A running request the queue does
    not name is aborted first.
    """
    start = time.perf_counter()
    meter = SlotMeter(engine, max_sequences)
    running = set(engine.pending_ids())
    if running:
        named = {r.request_id for r in queue}
        stray = [rid for rid in running if rid not in named]
        if stray:
            engine.abort(stray)
    continued = tuple(r.request_id for r in queue if r.request_id in running)
    skip = set(continued)
    finished: list[GenResult] = []
    started = steps = 0
    while not rule.met():
        free = max_sequences - engine.num_unfinished()
        batch = []
        while free > len(batch) and started < len(queue):
            if queue[started].request_id not in skip:
                batch.append(queue[started])
            started += 1
        if batch:
            engine.submit(batch)
        if not engine.num_unfinished():
            break
        for res in meter.collect(max_steps=1):
            rule.observe(res)
            finished.append(res)
        steps += 1
    left = engine.pending_ids()
    aborted = engine.snapshot(left) if park else engine.abort(left)
    return RoundRun(finished=finished, aborted=aborted, started=started, seconds=time.perf_counter() - start,
                    busy_slot_seconds=meter.busy_slot_seconds, steps=steps, continued=continued)


class SlotMeter:
    """Slot-time accounting for the rollout bubble: how many sequences decode, for how long.

    ``collect`` runs engine steps; over one call, the sequences decoding are
    taken as those unfinished at its start, capped at the engine's
    ``max_concurrent_sequences`` (short calls keep this close: ``max_steps``
    is small).
    """

    def __init__(self, engine: Engine, max_sequences: int) -> None:
        self.engine, self.max_sequences = engine, max_sequences
        self.busy_slot_seconds = 0.0

    def collect(self, max_steps: int) -> list[GenResult]:
        running = min(self.engine.num_unfinished(), self.max_sequences)
        start = time.perf_counter()
        out = self.engine.collect(max_steps=max_steps)
        self.busy_slot_seconds += running * (time.perf_counter() - start)
        return out
