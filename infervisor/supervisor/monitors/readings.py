"""What a monitor shows in status and /metrics: readings declared on its table entry and reported each snapshot.

A monitor with figures worth showing declares them as `Reading`s on its `MonitorEntry` and has a
`readings(config) -> Readings` method. Every snapshot (observe/capture.py) collects them from every
entry that declares any; status (observe/status.py) shows each under its key and the exposition
(observe/exposition.py) renders each one that names a metric as one family. Neither names a monitor.

Where a reading lands, by its scope:

| scope | status | metric labels |
|---|---|---|
| `BOX` | `status[ENTRY NAME][key]` (only the keys the monitor reported) | none |
| `MODEL` | `models.NAME[key]` (nil when it reported nothing for the model) | `model` |
| `WORKER` | `models.NAME.workers[i][key]` (nil when it has no sample of the worker) | `model`, `slot`, `pid` |
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from infervisor.supervisor.settings.config import Config

#: A reading's value: plain data the monitor does not change after handing it over (the snapshot is read by the
#: metrics thread). A metric shows only numbers (a bool as 0/1); a string or a mapping is for status.
Value = bool | int | float | str | Mapping[str, object] | None


class Scope(enum.Enum):
    """What one value of a reading is about."""

    BOX = "box"  # the box or the daemon: one value
    MODEL = "model"  # one value per served model
    WORKER = "worker"  # one value per worker process


@dataclass(frozen=True)
class Reading:
    """One figure a monitor shows: its status key, its scope, and the metric family rendering it."""

    key: str
    scope: Scope
    #: The metric family's help text (and what the figure means).
    help: str
    #: The family's name (`infervisor_...`, base units); None: shown in status only.
    metric: str | None = None
    #: A counter (its family gets `_total`) rather than a gauge.
    counter: bool = False
    #: The family's unit, e.g. "bytes" (the name must already end with it).
    unit: str = ""
    #: Status only, WORKER scope: read a worker the monitor has not sampled yet (a starting one) now, by pid.
    read_now: Callable[[int], Value] | None = None


@dataclass(frozen=True)
class Readings:
    """What a monitor reports now, by scope: key -> value; per model name; per worker pid."""

    box: Mapping[str, Value] = field(default_factory=dict)
    models: Mapping[str, Mapping[str, Value]] = field(default_factory=dict)
    workers: Mapping[int, Mapping[str, Value]] = field(default_factory=dict)


class ReadingSource(Protocol):
    """A monitor whose entry declares readings: it reports their values (fresh mappings) when asked."""

    def readings(self, config: Config) -> Readings:
        """Its figures now; `config` is the serving config (which models are served, their settings)."""
        ...


@dataclass(frozen=True)
class MonitorReadings:
    """One monitor's declared readings and the values it reported, as a snapshot holds them."""

    name: str
    declared: tuple[Reading, ...]
    values: Readings

    def of(self, scope: Scope) -> tuple[Reading, ...]:
        """Its declared readings of one scope."""
        return tuple(reading for reading in self.declared if reading.scope is scope)


def check_declarations(entries: Sequence[tuple[str, Sequence[Reading]]]) -> None:
    """Raise ValueError when two readings of one scope share a key, or two share a metric name."""
    seen: dict[object, str] = {}
    for name, declared in entries:
        for reading in declared:
            marks: list[object] = [(reading.scope, reading.key), *([reading.metric] if reading.metric else [])]
            for mark in marks:
                if mark in seen:
                    raise ValueError(f"monitor {name!r}: reading {reading.key!r} clashes with monitor {seen[mark]!r}'s")
                seen[mark] = name
