"""Heat and clock: zone temperatures, throttle counters and cpufreq from sysfs (root configurable for tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.readings import Reading, Readings, Scope
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.config import Config


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


#: Status `thermal`: the sensors' figures from the first read on; `throttled` and `shedding` from the start.
THERMAL_READINGS = (
    Reading("max_temp_c", Scope.BOX, "hottest thermal zone", metric="infervisor_cpu_temperature_celsius"),
    Reading(
        "throttle_events",
        Scope.BOX,
        "the kernel's core and package throttle counts, summed",
        metric="infervisor_cpu_throttle_events",
        counter=True,
    ),
    Reading(
        "min_freq_ratio",
        Scope.BOX,
        "lowest current/maximum clock over the CPUs",
        metric="infervisor_cpu_frequency_ratio",
    ),
    Reading("throttled", Scope.BOX, "1 while the CPU throttles or runs too hot", metric="infervisor_thermal_throttled"),
    # Asked for by its SHED finding, which the responses table acts on in the same turn, before the snapshot.
    Reading(
        "shedding",
        Scope.BOX,
        "1 while throttling routes to half of each model's workers",
        metric="infervisor_thermal_shedding",
    ),
)


class ThermalWatch:
    """Reports throttling as an event and a status field; it never restarts workers (that does not cool a CPU)."""

    def __init__(self) -> None:
        self.root = Path("/sys")
        self.last_throttle_count: int | None = None
        self.throttled = False
        #: Whether it last asked for load shedding (while throttled, with `thermal_action` "shed").
        self.shedding = False
        self.reading: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        """Current temperatures (C), summed throttle events and the lowest cur/max frequency ratio."""
        temps = [
            t / 1000.0
            for zone in sorted(self.root.glob("class/thermal/thermal_zone*/temp"))
            if (t := _read_int(zone)) is not None
        ]
        if str(self.root) == "/sys" and hasattr(psutil, "sensors_temperatures"):
            for entries in psutil.sensors_temperatures().values():
                temps.extend(e.current for e in entries if e.current)
        counts = [
            c
            for name in ("core_throttle_count", "package_throttle_count")
            for path in self.root.glob(f"devices/system/cpu/cpu[0-9]*/thermal_throttle/{name}")
            if (c := _read_int(path)) is not None
        ]
        ratios = []
        for cpufreq in self.root.glob("devices/system/cpu/cpu[0-9]*/cpufreq"):
            current, maximum = _read_int(cpufreq / "scaling_cur_freq"), _read_int(cpufreq / "cpuinfo_max_freq")
            if current and maximum:
                ratios.append(current / maximum)
        return {
            "max_temp_c": max(temps) if temps else None,
            "throttle_events": sum(counts) if counts else None,
            "min_freq_ratio": round(min(ratios), 3) if ratios else None,
        }

    def readings(self, config: Config) -> Readings:
        """The last sensor read (none before the first), whether it judged the box throttled, and asked to shed."""
        return Readings(box={**self.reading, "throttled": self.throttled, "shedding": self.shedding})

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """A finding when throttling starts or ends, and one when load shedding should start or end."""
        root = Path(view.config.thermal_sysfs_root)
        if root != self.root:  # a reload pointed the monitor elsewhere: counters there start afresh
            self.root, self.last_throttle_count = root, None
        finding = self.judge(view.config.thermal_max_c)
        findings = [] if finding is None else [finding]
        shed = self.throttled and view.config.thermal_action == "shed"
        if shed != self.shedding:
            self.shedding = shed
            findings.append(Finding("load_shedding", Action.SHED, None, {"shed": shed}))
        return findings

    def judge(self, max_temp_c: float | None) -> Finding | None:
        """Read the sensors once; a finding when throttling starts or ends."""
        reading = self.read()
        count = reading["throttle_events"]
        new_events = count is not None and self.last_throttle_count is not None and count > self.last_throttle_count
        self.last_throttle_count = count
        too_hot = max_temp_c is not None and reading["max_temp_c"] is not None and reading["max_temp_c"] >= max_temp_c
        throttled = new_events or too_hot
        reading["throttled"] = throttled
        self.reading = reading
        if throttled == self.throttled:
            return None
        self.throttled = throttled
        return Finding("thermal_throttle" if throttled else "thermal_recovered", Action.NOTE, None, reading)
