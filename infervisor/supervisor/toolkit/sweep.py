"""`infervisor optimize`'s sweep: every profile at every layout, in pinned `infervisor.worker.bench` processes.

For each cores-per-worker count, one process on the first worker's cores builds the profile and checks
it; siblings on the other workers' cores build it too. Then the first W processes run requests back to
back at once: their counts add up to the throughput of W workers with every worker busy, which is where
neighbours on one box slow each other (memory bandwidth, a shared L3); W = 1 is the idle figure
(sequential P50/P99, the other workers idle). Each W runs ROUNDS short windows, interleaved with the
other Ws' (in alternating order), so a slow spell of a shared box falls on every layout alike; a figure is
the median over its windows, with their spread. A figure the cores cannot explain (more QPS than the
added workers bring, a busy P99 below the idle one) is measured again, and still so, marked suspect.
"""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from infervisor.protocol.launch import LaunchSpec
from infervisor.supervisor.toolkit.layouts import Layout


class ChildFailed(Exception):
    """A measuring process exited, timed out or printed nothing usable; the message says which."""


@dataclass(frozen=True)
class Point:
    """One profile at one layout, as measured in process."""

    profile: str
    layout: Layout
    #: Sequential batch-1 latency of one worker (the others idle).
    p50_ms: float
    p99_ms: float
    #: Requests per second with all the layout's workers busy.
    qps: float
    #: The worst worker's P99 while all of them were busy.
    busy_p99_ms: float
    #: (max - min) / median of the QPS and of the P99 (busy for several workers) over the windows.
    qps_spread: float = 0.0
    p99_spread: float = 0.0
    windows: int = 1
    #: Why the figures contradict the idle worker's even after a second measurement (never chosen), or None.
    suspect: str | None = None
    #: What the first measurement contradicted, when it was measured again (None: it held the first time).
    remeasured: str | None = None
    #: The sizes measured at (ServedSizes.text).
    measured_at: str = ""

    def as_json(self) -> dict[str, Any]:
        """A JSON-able map (the layout as "WxC")."""
        return {
            "profile": self.profile, "layout": str(self.layout), "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
            "qps": self.qps, "busy_p99_ms": self.busy_p99_ms, "qps_spread": self.qps_spread,
            "p99_spread": self.p99_spread, "windows": self.windows, "suspect": self.suspect,
            "remeasured": self.remeasured, "measured_at": self.measured_at,
        }  # fmt: skip


#: Windows per worker count, interleaved with the other counts'.
ROUNDS = 3
#: The shortest window (s): a --seconds split in ROUNDS is not cut below it.
MIN_WINDOW_S = 0.2
#: W workers may show at most W x this the QPS of one before the figure is a contradiction (W x the cores, plus
#: the noise of short windows); a busy P99 below this x the idle one is one too.
SCALING_SLACK = 1.25
BUSY_SLACK = 0.8


@dataclass(frozen=True)
class Figures:
    """One worker count's windows, summarised: medians and their (max - min) / median."""

    qps: float
    p50_ms: float
    p99_ms: float
    qps_spread: float
    p99_spread: float

    @classmethod
    def of(cls, windows: list[list[dict[str, Any]]]) -> Figures:
        """The summary of windows, each the load answers of every busy worker."""
        qps = [sum(load["count"] / max(load["seconds"], 1e-9) for load in window) for window in windows]
        p99 = [max(load["p99_ms"] for load in window) for window in windows]
        p50 = [max(load["p50_ms"] for load in window) for window in windows]
        return cls(
            round(statistics.median(qps), 1), statistics.median(p50), statistics.median(p99), _spread(qps),
            _spread(p99),
        )  # fmt: skip


def _spread(values: list[float]) -> float:
    middle = statistics.median(values)
    return round((max(values) - min(values)) / middle, 3) if middle > 0 else 0.0


def contradiction(idle: Figures, busy: Figures, workers: int) -> str | None:
    """Why `workers` busy workers' figures cannot be right next to one idle worker's, or None."""
    if busy.qps > idle.qps * workers * SCALING_SLACK:
        return (
            f"{busy.qps:.1f} QPS with {workers} workers is x{busy.qps / idle.qps:.1f} one worker's {idle.qps:.1f}: "
            f"more than {workers} workers' cores can add"
        )
    if busy.p99_ms < idle.p99_ms * BUSY_SLACK:
        return f"busy P99 {busy.p99_ms:.2f} ms below the idle worker's {idle.p99_ms:.2f} ms"
    return None


@dataclass(frozen=True)
class SweepOptions:
    """How long each measurement runs and how long a process may take."""

    seconds: float
    batch: int
    timeout: float
    cache_dir: Path
    #: The batch-1 sizes measured at, in turn: ServedSizes.as_json() (None: the declared example).
    sizes: list[dict[str, list[int]]] | None = None
    #: What they are, which every figure states (ServedSizes.text).
    measured_at: str = ""


class BenchChild:
    """One pinned `python -m infervisor.worker.bench --hold` process holding one built profile."""

    def __init__(
        self, launch: LaunchSpec, profile: str, cpus: tuple[int, ...], options: SweepOptions, build_only: bool
    ) -> None:
        command = [
            sys.executable, "-P", "-m", "infervisor.worker.bench", "--launch", launch.to_json(), "--profiles", profile,
            "--cpus", ",".join(map(str, cpus)), "--batch", str(options.batch), "--seconds", str(options.seconds),
            "--cache-dir", str(options.cache_dir), "--started-at", repr(time.time()), "--hold",
        ]  # fmt: skip
        if build_only:
            command.append("--build-only")
        if options.sizes:
            command += ["--sizes", json.dumps(options.sizes)]
        self.timeout = options.timeout
        # A file, not a pipe: torch's warnings would fill a pipe nobody reads and stall the child.
        self.errors: IO[bytes] = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors)

    def _line(self, accept: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The next JSON line `accept` takes, skipping others; ChildFailed on exit or timeout."""
        stdout = self.process.stdout
        if stdout is None:
            raise ChildFailed("no stdout")
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChildFailed(f"no answer within --timeout {self.timeout:.0f} s")
            ready, _, _ = select.select([stdout], [], [], remaining)
            if not ready:
                continue
            line = stdout.readline()
            if not line:
                self.process.wait()
                self.errors.seek(0)
                tail = self.errors.read()[-400:].decode(errors="replace")
                raise ChildFailed(f"measurement failed ({self.process.returncode}): {tail}")
            if line.startswith(b"{"):
                value: dict[str, Any] = json.loads(line)
                if accept(value):
                    return value

    def row(self) -> dict[str, Any]:
        """The profile's row (after the input-spec line)."""
        return self._line(lambda value: "profile" in value)

    def start_load(self, seconds: float) -> None:
        """Tell the process to run back-to-back requests for `seconds`."""
        if self.process.stdin is not None:
            self.process.stdin.write(f"load {seconds}\n".encode())
            self.process.stdin.flush()

    def load_result(self) -> dict[str, Any]:
        """The answer to start_load: count, seconds and percentiles."""
        answer: dict[str, Any] = self._line(lambda value: "load" in value)["load"]
        return answer

    def close(self) -> None:
        """Ask it to quit (EOF on stdin), then make sure it is gone."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.errors.close()


def _windows(children: list[BenchChild], counts: list[int], seconds: float) -> dict[int, Figures]:
    """ROUNDS windows of each worker count, interleaved (the order reversed every other round), summarised."""
    windows: dict[int, list[list[dict[str, Any]]]] = {count: [] for count in counts}
    for round_ in range(ROUNDS):
        for count in counts if round_ % 2 == 0 else reversed(counts):
            busy = children[:count]
            for child in busy:
                child.start_load(seconds)
            windows[count].append([child.load_result() for child in busy])
    return {count: Figures.of(found) for count, found in windows.items()}


def _contradictions(figures: dict[int, Figures]) -> dict[int, str]:
    return {w: why for w, f in figures.items() if w > 1 and (why := contradiction(figures[1], f, w)) is not None}


def measure_cores(
    launch: LaunchSpec, profile: str, layouts: list[Layout], placements: list[tuple[int, ...]], options: SweepOptions
) -> tuple[dict[str, Any], list[Point], list[dict[str, Any]]]:
    """One profile at every layout of one cores-per-worker count: its row, its points, and the siblings' rows.

    `placements` are the CPUs of the most workers that fit; layouts with fewer use the first ones.
    """
    first = BenchChild(launch, profile, placements[0], options, build_only=False)
    children = [first]
    try:
        row = first.row()
        if "p50_ms" not in row:
            return row, [], []
        # One at a time: siblings that compile at once would only wait on the package's lock anyway.
        siblings = []
        for cpus in placements[1 : max(layout.workers for layout in layouts)]:
            children.append(BenchChild(launch, profile, cpus, options, build_only=True))
            siblings.append(children[-1].row())
        counts = sorted({1, *(layout.workers for layout in layouts)})
        window = max(MIN_WINDOW_S, options.seconds / ROUNDS)
        figures = _windows(children, counts, window)
        first_read = _contradictions(figures)
        if first_read:
            figures = _windows(children, counts, window)
        still = _contradictions(figures)
        idle = figures[1]
        points = [
            Point(
                profile,
                layout,
                round(idle.p50_ms, 4),
                round(idle.p99_ms, 4),
                figures[layout.workers].qps,
                round(figures[layout.workers].p99_ms, 4),
                figures[layout.workers].qps_spread,
                figures[layout.workers].p99_spread,
                ROUNDS * (2 if first_read else 1),
                still.get(layout.workers),
                first_read.get(layout.workers),
                options.measured_at,
            )  # fmt: skip
            for layout in layouts
        ]
        return row, points, siblings
    finally:
        for child in children:
            child.close()


def restart_of(launch: LaunchSpec, profile: str, cpus: tuple[int, ...], options: SweepOptions) -> float | None:
    """Spawn to built of one more process, once the package is cached: the cold start of a restarted worker."""
    child = BenchChild(launch, profile, cpus, options, build_only=True)
    try:
        started = child.row().get("cold_start_s")
    except ChildFailed:
        return None
    finally:
        child.close()
    return float(started) if started is not None else None


def auto_pick(launch: LaunchSpec, cpus: tuple[int, ...], options: SweepOptions) -> dict[str, Any]:
    """What a worker's own `pick: fastest` over the launch's chain serves on these cpus (decided afresh)."""
    command = [
        sys.executable, "-P", "-m", "infervisor.worker.bench", "--launch", launch.to_json(), "--pick",
        "--cpus", ",".join(map(str, cpus)), "--cache-dir", str(options.cache_dir),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ChildFailed(f"the pick took longer than --timeout {options.timeout:.0f} s") from exc
    picks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"pick"')]
    if done.returncode != 0 or not picks:
        raise ChildFailed(f"the pick failed ({done.returncode}): {done.stderr[-400:]}")
    answer: dict[str, Any] = picks[0]
    return answer
