"""The daemon's monitors, one table: each monitor's name, what it watches, and how to build it.

core/assembly.py builds the monitors from `MONITORS` once at start, the arbiter runs every one each turn;
adding a monitor is one module in this package and one entry here. What a monitor shows in status and
/metrics it declares on its entry (`readings`, monitors/readings.py) and reports through its `readings`
method; the snapshot collects them from every entry. A few monitors are reached beyond their findings and
readings (heat for the idle-polling hold, canary verdicts for worker replies, the audit's wiring to the
runner whose verdicts it judges): `Monitors` names those, typed, by their class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from infervisor.supervisor.monitors.age import AgeWatch
from infervisor.supervisor.monitors.audit import AUDIT_READINGS, AuditWatch
from infervisor.supervisor.monitors.canary import CanaryWatch
from infervisor.supervisor.monitors.drift import DriftWatch
from infervisor.supervisor.monitors.findings import Finding
from infervisor.supervisor.monitors.memory import MEMORY_READINGS, MemoryWatch
from infervisor.supervisor.monitors.readings import MonitorReadings, Reading, ReadingSource, check_declarations
from infervisor.supervisor.monitors.thermal import THERMAL_READINGS, ThermalWatch
from infervisor.supervisor.monitors.view import Monitor, MonitorView
from infervisor.supervisor.settings.config import Config

Watch = TypeVar("Watch")


@dataclass(frozen=True)
class MonitorEntry:
    """One monitor: its name, a one-line summary of what it watches, a builder of its (stateful) instance, and
    what it shows in status and /metrics (its instance then has `readings(config)`: monitors/readings.py)."""

    name: str
    summary: str
    build: Callable[[], Monitor]
    readings: tuple[Reading, ...] = ()


#: Run in this order each monitor turn; their findings are acted on in the same order.
MONITORS: tuple[MonitorEntry, ...] = (
    MonitorEntry(
        "memory", "RSS limits and leak slope per worker (PSS sampled alongside)", MemoryWatch, MEMORY_READINGS
    ),
    MonitorEntry("age", "planned recycling at max_age_s or max_requests, with jitter", AgeWatch),
    MonitorEntry("drift", "a worker slower than its own warm baseline while its siblings are not", DriftWatch),
    MonitorEntry("canary", "golden inputs rerun periodically must match the worker's warm-up outputs", CanaryWatch),
    MonitorEntry(
        "thermal", "zone temperatures, throttle counters and clock from sysfs", ThermalWatch, THERMAL_READINGS
    ),
    MonitorEntry(
        "audit",
        "verdicts on served answers of optimised profiles, sampled within a CPU budget and rerun on eager fp32",
        AuditWatch,
        AUDIT_READINGS,
    ),
)


class Monitors:
    """The monitors built from the table, run together; the few whose state the daemon uses, by their class."""

    def __init__(
        self, watches: Sequence[Monitor], reporting: Sequence[tuple[MonitorEntry, ReadingSource]] = ()
    ) -> None:
        self.all: tuple[Monitor, ...] = tuple(watches)
        #: The entries that declare readings, each with its instance.
        self.reporting = tuple(reporting)
        self.canaries = self.one(CanaryWatch)
        self.thermal = self.one(ThermalWatch)
        self.audit = self.one(AuditWatch)

    def one(self, kind: type[Watch]) -> Watch:
        """The one monitor of this class (the daemon reads its state, so the table must hold exactly one)."""
        found = [watch for watch in self.all if isinstance(watch, kind)]
        if len(found) != 1:
            raise LookupError(f"the monitor table builds {len(found)} {kind.__name__}; the daemon needs exactly one")
        return found[0]

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Every monitor's findings this turn, in table order."""
        return [finding for watch in self.all for finding in watch.check(now, view)]

    def readings(self, config: Config) -> tuple[MonitorReadings, ...]:
        """What every monitor that declares readings reports now, in table order (for the snapshot)."""
        return tuple(
            MonitorReadings(entry.name, entry.readings, source.readings(config)) for entry, source in self.reporting
        )


def build_monitors() -> Monitors:
    """A fresh instance of every monitor in `MONITORS` (read when called, so a test may extend the table).

    An entry that declares readings must build a monitor with a `readings` method, and no two readings may
    share a status key (in one scope) or a metric name: either is a ValueError here, at start.
    """
    entries = MONITORS
    check_declarations([(entry.name, entry.readings) for entry in entries])
    watches = [entry.build() for entry in entries]
    reporting = []
    for entry, watch in zip(entries, watches, strict=True):
        if not entry.readings:
            continue
        if not callable(getattr(watch, "readings", None)):
            raise ValueError(f"monitor {entry.name!r} declares readings but has no readings(config) method")
        reporting.append((entry, cast(ReadingSource, watch)))
    return Monitors(watches, reporting)
