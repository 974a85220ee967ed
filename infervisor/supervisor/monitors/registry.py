"""The daemon's monitors, one table: each monitor's name, what it watches, and how to build it.

core/assembly.py builds the monitors from `MONITORS` once at start, the arbiter runs every one each turn;
adding a monitor is one module in this package and one entry here. A few monitors keep readings the
daemon uses beyond their findings (heat for the idle-polling hold and load shedding, memory samples
for the metrics, canary verdicts for worker replies, the audit's sampler for the broker): `Monitors`
names those, typed, by their class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from infervisor.supervisor.monitors.age import AgeWatch
from infervisor.supervisor.monitors.audit import AuditWatch
from infervisor.supervisor.monitors.canary import CanaryWatch
from infervisor.supervisor.monitors.drift import DriftWatch
from infervisor.supervisor.monitors.findings import Finding
from infervisor.supervisor.monitors.memory import MemoryWatch
from infervisor.supervisor.monitors.thermal import ThermalWatch
from infervisor.supervisor.monitors.view import Monitor, MonitorView

Watch = TypeVar("Watch")


@dataclass(frozen=True)
class MonitorEntry:
    """One monitor: its name, a one-line summary of what it watches, and a builder of its (stateful) instance."""

    name: str
    summary: str
    build: Callable[[], Monitor]


#: Run in this order each monitor turn; their findings are acted on in the same order.
MONITORS: tuple[MonitorEntry, ...] = (
    MonitorEntry("memory", "RSS limits and leak slope per worker (PSS sampled alongside)", MemoryWatch),
    MonitorEntry("age", "planned recycling at max_age_s or max_requests, with jitter", AgeWatch),
    MonitorEntry("drift", "a worker slower than its own warm baseline while its siblings are not", DriftWatch),
    MonitorEntry("canary", "golden inputs rerun periodically must match the worker's warm-up outputs", CanaryWatch),
    MonitorEntry("thermal", "zone temperatures, throttle counters and clock from sysfs", ThermalWatch),
    MonitorEntry(
        "audit", "served answers of optimised profiles, sampled within a CPU budget, rerun on eager fp32", AuditWatch
    ),
)


class Monitors:
    """The monitors built from the table, run together; the few whose readings the daemon uses, by their class."""

    def __init__(self, watches: Sequence[Monitor]) -> None:
        self.all: tuple[Monitor, ...] = tuple(watches)
        self.memory = self.one(MemoryWatch)
        self.canaries = self.one(CanaryWatch)
        self.thermal = self.one(ThermalWatch)
        self.audit = self.one(AuditWatch)

    def one(self, kind: type[Watch]) -> Watch:
        """The one monitor of this class (the daemon reads its readings, so the table must hold exactly one)."""
        found = [watch for watch in self.all if isinstance(watch, kind)]
        if len(found) != 1:
            raise LookupError(f"the monitor table builds {len(found)} {kind.__name__}; the daemon needs exactly one")
        return found[0]

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Every monitor's findings this turn, in table order."""
        return [finding for watch in self.all for finding in watch.check(now, view)]


def build_monitors() -> Monitors:
    """A fresh instance of every monitor in `MONITORS` (read when called, so a test may extend the table)."""
    return Monitors([entry.build() for entry in MONITORS])
