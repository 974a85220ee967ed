"""What a background build costs serving: P50/P99 with the builder running against the same builder stopped.

    python bench/build_p99.py [--config configs/default.json] [--arms build,yield,paused,gated,onecore] [--rounds 6]
        [--window-s 20] [--rate 4] [--clients 2] [--max-minutes 15]

The daemon starts on the config with a private, empty cache, so its workers serve first (eager) and the background
builder builds the chain behind them. Under a bounded load (--clients clients, each sending one request every
1/--rate s, or back to back with --rate 0) each round measures one window per arm, the arms' order turned by one
each round, so the same workers serving the same profile on the same box are compared and drifting load from others
weighs on every arm alike. Arms: `build` (the builder at idle priority, the daemon's gate off: build_yield false),
`yield` (the daemon's own gate: build_yield true, the default), `paused` (its whole process group,
compilers too, stopped by SIGSTOP: no build), `gated` (the group stopped while any request of the load is in flight
and continued when none is) and `onecore` (the group pinned to the box's last cpu). A round counts only when the same
builder was building throughout; a build that ends is followed by a fresh daemon on another empty cache. Printed per
round: each arm's P50/P99, requests and the CPU seconds the builder's group got, each arm's P99 over `paused`, the
load average; then per arm the medians of the rounds' ratios and the pooled figures. Bounded by --max-minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.daemon import start_daemon, stop_daemon  # noqa: E402
from infervisor.protocol import Client, InferenceError  # noqa: E402
from infervisor.protocol.control_client import ControlError, control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Window:
    """One arm's window: its requests' latencies, the builder group's CPU seconds, the load average."""

    arm: str
    latencies: list[float]
    builder_cpu_s: float
    load: float

    def at(self, q: float) -> float:
        return percentile(self.latencies, q) or float("nan")


class Load:
    """Clients each sending one request every `period` s (back to back when 0); `gate`, when set, is a builder's
    process group stopped while any request is in flight and continued when none is (the `gated` arm)."""

    def __init__(self, endpoint: str, model: str, inputs: dict[str, np.ndarray], clients: int, period: float) -> None:
        self.endpoint, self.model, self.inputs, self.period = endpoint, model, inputs, period
        self.samples: list[tuple[float, float]] = []  # (sent at, latency ms)
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.gate: int | None = None
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def mark(self, delta: int) -> None:
        with self.lock:
            self.in_flight += delta
            if self.gate is not None and self.in_flight == (1 if delta > 0 else 0):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.gate, signal.SIGSTOP if delta > 0 else signal.SIGCONT)

    def run(self) -> None:
        with Client(self.endpoint) as client:
            due = time.monotonic()
            while not self.stop.is_set():
                started = time.monotonic()
                self.mark(1)
                try:
                    client.infer(self.model, self.inputs, timeout=120)
                    self.samples.append((started, (time.monotonic() - started) * 1000.0))
                except InferenceError as exc:
                    self.failures.append(f"{exc.code}: {exc.message}")
                finally:
                    self.mark(-1)
                due = max(due + self.period, time.monotonic())
                self.stop.wait(max(0.0, due - time.monotonic()))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)


def builder_of(runtime: Path, model: str) -> tuple[int, str] | None:
    """The pid and phase of the model's builder while its build state is `building`, else None."""
    try:
        status = control_request(runtime, {"cmd": "status"}, timeout=10.0)
    except ControlError:
        return None
    build: dict[str, Any] = status["models"][model].get("build") or {}
    pid = build.get("pid")
    if build.get("state") != "building" or not isinstance(pid, int):
        return None
    return pid, f"{build.get('phase') or 'starting'} {build.get('profile') or ''}".strip()


def members(pgid: int) -> list[tuple[int, list[str]]]:
    """The processes of a group with their /proc stat fields after the name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields[0] is the state; pgrp is the third field after the name
            found.append((int(entry.name), fields))
    return found


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of a process group: its live members' own, plus what the leader's reaped children used."""
    total = 0
    for pid, fields in members(pgid):
        total += int(fields[11]) + int(fields[12])
        if pid == pgid:
            total += int(fields[13]) + int(fields[14])
    return total / _TICKS


def pin_group(pgid: int, cpus: set[int]) -> None:
    """Every thread of every process of the group on `cpus` (what they start inherits it)."""
    for pid, _ in members(pgid):
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.sched_setaffinity(int(task.name), cpus)
        except OSError:
            continue


def set_yield(runtime: Path, model: str, on: bool) -> None:
    """Turn the daemon's own build gate (config build_yield) on or off, and wait until its status says so."""
    path = runtime.parent / f"{runtime.name}-config.json"
    config = json.loads(path.read_text())
    if config.get("build_yield", True) != on:
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps({**config, "build_yield": on}))
        os.replace(temp, path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = control_request(runtime, {"cmd": "status"}, timeout=10.0)
        build = status["models"][model].get("build") or {}
        if build.get("state") != "building":
            raise ProcessLookupError("the build ended")  # the round is dropped, as when the builder is gone
        if (build.get("gate") or {}).get("on") == on:
            return
        time.sleep(0.1)
    raise SystemExit(f"the daemon did not turn build_yield {'on' if on else 'off'} within 30 s")


def measure(load: Load, arm: str, pgid: int, seconds: float, runtime: Path) -> Window:
    """One window of `seconds` under the running load, with the builder's group as the arm says."""
    set_yield(runtime, load.model, arm == "yield")
    allowed = os.sched_getaffinity(pgid)
    if arm != "yield":  # the daemon's gate, off in every other arm, has the group running now
        os.killpg(pgid, signal.SIGSTOP if arm == "paused" else signal.SIGCONT)
    if arm == "onecore":
        pin_group(pgid, {max(allowed)})
    if arm == "gated":
        with load.lock:
            load.gate = pgid
            if load.in_flight:
                os.killpg(pgid, signal.SIGSTOP)
    cpu_before, since = group_cpu_s(pgid), time.monotonic()
    time.sleep(seconds)
    until = time.monotonic()
    cpu = group_cpu_s(pgid) - cpu_before
    with load.lock:
        load.gate = None
    with contextlib.suppress(ProcessLookupError):  # the builder ended meanwhile: the round is dropped
        if arm != "yield":
            os.killpg(pgid, signal.SIGCONT)
    if arm == "onecore":
        pin_group(pgid, allowed)
    chosen = [ms for at, ms in load.samples if since <= at < until]
    return Window(arm, chosen, cpu, os.getloadavg()[0])


def start(config: dict[str, Any], folder: Path, index: int) -> tuple[Any, Path]:
    """A daemon on the config with an empty cache of its own, every worker serving."""
    config = {**config, "cache_dir": str(folder / f"cache-{index}")}
    runtime = folder / f"run-{index}"
    return start_daemon(config, runtime), runtime


def await_builder(runtime: Path, model: str, deadline: float) -> tuple[int, str] | None:
    while time.monotonic() < deadline:
        builder = builder_of(runtime, model)
        if builder is not None:
            return builder
        time.sleep(0.5)
    return None


def run(args: argparse.Namespace, config: dict[str, Any], folder: Path) -> list[list[Window]]:
    """Rounds of one window per arm, the arms' order turned by one each round; each round on one builder."""
    model = next(iter(config["models"]))
    spec = config["models"][model]["inputs"][0]
    shape = [1 if d is None else d for d in spec["shape"]]
    inputs = {spec["name"]: np.random.default_rng(0).uniform(0, 1, shape).astype(np.float32)}
    deadline = time.monotonic() + args.max_minutes * 60
    rounds: list[list[Window]] = []
    starts = 0
    while len(rounds) < args.rounds and time.monotonic() < deadline:
        daemon, runtime = start(config, folder, starts)
        starts += 1
        period = 1.0 / args.rate if args.rate > 0 else 0.0
        load = Load(f"ipc://{runtime}/infer.sock", model, inputs, args.clients, period)
        try:
            while len(rounds) < args.rounds and time.monotonic() < deadline:
                builder = await_builder(runtime, model, deadline)
                if builder is None:
                    break
                pid, phase = builder
                turn = len(rounds) % len(args.arms)
                order = args.arms[turn:] + args.arms[:turn]
                try:
                    windows = [measure(load, arm, pid, args.window_s, runtime) for arm in order]
                except ProcessLookupError:
                    windows = []
                after = builder_of(runtime, model)
                if after is None or after[0] != pid or not windows:
                    print(f"  (round dropped: the build ended or its builder changed, order {order})", flush=True)
                    break
                windows.sort(key=lambda w: args.arms.index(w.arm))
                rounds.append(windows)
                print(row(len(rounds), order[0], windows), f"{phase} .. {after[1]} |", flush=True)
            if load.failures:
                print(f"  {len(load.failures)} failed requests: {load.failures[:3]}", flush=True)
        finally:
            load.finish()
            stop_daemon(daemon)
    return rounds


def row(index: int, first: str, windows: list[Window]) -> str:
    """One round: each arm's P50 / P99 (n) and builder CPU, its P99 over the `paused` arm's, the load."""
    paused = next((w for w in windows if w.arm == "paused"), windows[-1])
    cells = [f"{w.at(50):.0f} / {w.at(99):.0f} ({len(w.latencies)}), {w.builder_cpu_s:.1f} s" for w in windows]
    ratios = [f"{w.at(99) / paused.at(99):.2f}" for w in windows if w is not paused]
    return f"| {index} | {first} | {' | '.join(cells)} | {' | '.join(ratios)} | {windows[0].load:.1f} |"


def summary(rounds: list[list[Window]], arms: list[str]) -> list[str]:
    """Per arm: the median of its per-round P99 and P50 ratios to `paused`, and its pooled P50/P99."""
    lines = []
    base = arms.index("paused") if "paused" in arms else len(arms) - 1
    pooled_base = [ms for r in rounds for ms in r[base].latencies]
    for index, arm in enumerate(arms):
        pooled = [ms for r in rounds for ms in r[index].latencies]
        p99s = [r[index].at(99) / r[base].at(99) for r in rounds]
        p50s = [r[index].at(50) / r[base].at(50) for r in rounds]
        pooled_ratio = (percentile(pooled, 99) or 0) / (percentile(pooled_base, 99) or 1)
        lines.append(
            f"| {arm} | {percentile(pooled, 50):.0f} / {percentile(pooled, 99):.0f} ({len(pooled)}) | "
            f"{statistics.median(p99s):.2f} ({', '.join(f'{x:.2f}' for x in p99s)}) | {pooled_ratio:.2f} | "
            f"{statistics.median(p50s):.2f} | {statistics.median(r[index].builder_cpu_s for r in rounds):.1f} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.json"), help="the config to start")
    parser.add_argument(
        "--arms", default="build,yield,paused", help="builder states compared: build, yield, paused, gated, onecore"
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one window per arm")
    parser.add_argument("--window-s", type=float, default=20.0, help="seconds of each window")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second per client (0: back to back)")
    parser.add_argument("--clients", type=int, default=2, help="clients of the load")
    parser.add_argument("--max-minutes", type=float, default=15.0, help="stop after this many minutes")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    config = json.loads(Path(args.config).read_text())
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]), flush=True)
    print(f"{os.cpu_count()} cpus, load {args.clients} clients x {args.rate:g} req/s, windows {args.window_s:g} s, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    others = [a for a in args.arms if a != "paused"]
    print(f"| round | first | {' | '.join(f'{a} P50 / P99 ms (n), builder CPU' for a in args.arms)} | "
          f"{' | '.join(f'{a} P99 / paused' for a in others)} | load avg |")  # fmt: skip
    print("|---" * (3 + len(args.arms) + len(others)) + "|", flush=True)
    with tempfile.TemporaryDirectory(prefix="infervisor-build-p99-") as temp:
        rounds = run(args, config, Path(temp))
    if not rounds:
        print("no round measured (no build ran within the limit)")
        return 1
    print(f"\n{len(rounds)} rounds, load average now {os.getloadavg()[0]:.1f}")
    print("| arm | pooled P50 / P99 ms (n) | P99 / paused, median of rounds (each) | pooled P99 / paused "
          "| P50 / paused | builder CPU s a window |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print("\n".join(summary(rounds, args.arms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
