"""How much of the machine's CPU time nothing ran on, from Linux's ``/proc/stat``.

The per-role idle fractions (``trainer_idle_fraction``,
``generator_idle_fraction``) say when a role waited; with flex workers
(docs/concepts.md "The elastic pool") a waiting trainer's core may generate, so a
role's idle time is not the device's. ``machine_cpu_idle_fraction`` is the
device's: the share of all cores' time, between two step records, that the
kernel spent idle (``idle`` + ``iowait`` over ``user`` + ``nice`` +
``system`` + ``irq`` + ``softirq`` + ``idle`` + ``iowait``). ``steal``
(time the hypervisor gave to other guests) counts on neither side; guest
time is already inside ``user``. Everything on the machine counts as busy,
the driver, the Prefect and MLflow servers and any other job included, so
the figure means "this run kept the cores busy" only where the run has the
machine to itself (``reflow bench``: ``resources.num_cpus`` = the cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTimes:
    """Clock ticks summed over all cores since boot."""

    idle: int
    total: int


def parse_cpu_line(line: str) -> CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat``: user nice system idle iowait irq softirq [steal ...]."""
    name, *fields = line.split()
    if name != "cpu" or len(fields) < 7:
        raise ValueError(f"not the aggregate cpu line of /proc/stat: {line!r}")
    user, nice, system, idle, iowait, irq, softirq = (int(f) for f in fields[:7])
    return CpuTimes(idle=idle + iowait, total=user + nice + system + idle + iowait + irq + softirq)


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """The machine's CPU ticks now; None where there is no ``/proc/stat`` (not Linux)."""
    try:
        with path.open() as f:
            return parse_cpu_line(f.readline())
    except OSError:
        return None


def idle_fraction(before: CpuTimes, after: CpuTimes) -> float | None:
    """Share of the CPU time between two readings that was idle; None if no tick passed."""
    total = after.total - before.total
    return (after.idle - before.idle) / total if total > 0 else None
