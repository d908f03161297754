"""Back-pressure of the streaming modes: how many more groups the feeder may submit.

The feeder keeps at most ``max(max_staleness_versions, 1) * groups_per_step``
groups *ahead* of the trainer (and at least one full batch): in flight, or
written and not yet trained on while still young enough to be admissible.
This is AReaL's rule for ``max_head_offpolicyness`` (``submitted <=
(trainer_version + max_staleness_versions + 1) * groups_per_step``) with one
version of slack: a group's version is its oldest token's, and the engine
loads new weights a moment after the trainer makes them, so a group admitted
at trainer version ``t`` may start at ``t - 1``; without the slack a steady
share of groups would age out unused. Counting only admissible groups also
covers groups that do age out (they would otherwise hold the gate shut
forever), and the one-batch floor means a closed gate with nothing in flight
always leaves a full batch of unused groups waiting (no deadlock). The bound
itself is enforced by the selection query (``storage.replay``), which never
returns a row older than ``trainer_version - max_staleness_versions``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessGate:
    """How many more groups the feeder may submit (the module docstring says why)."""

    max_staleness_versions: int
    groups_per_step: int  # unused groups one trainer step consumes
    batch_groups: int  # groups in one full batch

    @property
    def cap(self) -> int:
        """Most groups ahead of the trainer: ``max(max(S, 1) * groups_per_step, batch_groups)``."""
        return max(max(self.max_staleness_versions, 1) * self.groups_per_step, self.batch_groups)

    def allowed(self, ahead: int) -> int:
        """``cap - ahead``, at least 0; ``ahead``: groups in flight plus admissible unused ones."""
        return max(0, self.cap - ahead)
