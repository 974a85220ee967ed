"""`infervisor optimize`'s sweep: every profile at every layout, in pinned `infervisor.worker.bench` processes.

For each cores-per-worker count, one process on the first worker's cores builds the profile, checks
it and times it alone (sequential P50/P99: the other workers are idle then). Siblings on the other
workers' cores build it too, and then the first W processes run requests back to back at once:
their counts add up to the throughput of W workers with every worker busy, which is where
neighbours on one box slow each other (memory bandwidth, a shared L3).
"""

from __future__ import annotations

import json
import select
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

    def as_json(self) -> dict[str, Any]:
        """A JSON-able map (the layout as "WxC")."""
        return {
            "profile": self.profile, "layout": str(self.layout), "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
            "qps": self.qps, "busy_p99_ms": self.busy_p99_ms,
        }  # fmt: skip


@dataclass(frozen=True)
class SweepOptions:
    """How long each measurement runs and how long a process may take."""

    seconds: float
    batch: int
    timeout: float
    cache_dir: Path


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
        points = [
            Point(
                profile, Layout(1, layouts[0].cores_per_worker), row["p50_ms"], row["p99_ms"], row["qps"], row["p99_ms"]
            )
        ]
        most = max(layout.workers for layout in layouts)
        # One at a time: siblings that compile at once would only wait on the package's lock anyway.
        siblings = []
        for cpus in placements[1:most]:
            children.append(BenchChild(launch, profile, cpus, options, build_only=True))
            siblings.append(children[-1].row())
        for layout in layouts:
            if layout.workers == 1:
                continue
            busy = children[: layout.workers]
            for child in busy:
                child.start_load(options.seconds)
            loads = [child.load_result() for child in busy]
            qps = sum(load["count"] / max(load["seconds"], 1e-9) for load in loads)
            worst = max(load["p99_ms"] for load in loads)
            points.append(Point(profile, layout, row["p50_ms"], row["p99_ms"], round(qps, 1), worst))
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
