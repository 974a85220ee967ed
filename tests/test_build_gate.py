"""The build gate: a compiling background builder is stopped while requests are in flight, within its floor."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from infervisor.supervisor.lifecycle.build_gate import MAX_PAUSE_S, GateClock, GateState
from tests.conftest import Daemon, model_entry, wait_for
from tests.held_compile import end_held_compiles, start_held_compile
from tests.slow_model import SLOW_INPUTS, rounds, write_slow_model


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def _gate(daemon: Daemon) -> dict[str, Any]:
    return daemon.status()["models"]["t"]["build"]["gate"]


@contextmanager
def _busy(daemon: Daemon, timeout_s: float = 30.0) -> Iterator[list[str]]:
    """Two clients sending `slow` requests back to back (so one is always in flight) until the block ends; their
    failures are yielded, to be asserted empty."""
    done = threading.Event()
    failures: list[str] = []

    def send() -> None:
        with daemon.client() as client:
            while not done.is_set():
                try:
                    client.infer("slow", rounds(60), timeout=timeout_s)
                except Exception as exc:  # noqa: BLE001 - a failure is the finding, counted and asserted
                    failures.append(repr(exc))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield failures
    finally:
        done.set()
        for thread in threads:
            thread.join(60)


def _slow_model(folder: Path) -> dict[str, Any]:
    return model_entry({"torchscript": str(write_slow_model(folder))}, SLOW_INPUTS)


def test_a_compiling_builder_is_stopped_while_requests_are_in_flight_and_still_runs_its_floor(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """With requests in flight the builder and its g++ and cc1plus are stopped, and continued once none is; under
    3 s of back-to-back requests the floor still runs it (forced runs, stopped at most 1 s in a row); with
    `build_yield` false it is never stopped; no request fails."""
    models = {"slow": _slow_model(tmp_path)}
    daemon, builder, compilers = start_held_compile(start_daemon, tmp_path, models, oversubscribe=True)
    try:
        group = [builder, *(p.pid for p in compilers)]
        assert not any(_stopped(pid) for pid in group)
        assert _gate(daemon)["pauses"] == 0

        started = time.monotonic()
        longest_stop, stopped_since = 0.0, None
        with _busy(daemon) as failures:
            wait_for(lambda: _stopped(builder), 30, "the builder stopped while requests are in flight")
            assert all(_stopped(pid) for pid in group), "its compilers are stopped with it"
            while time.monotonic() - started < 3.0:
                now = time.monotonic()
                if _stopped(builder):
                    stopped_since = stopped_since or now
                    longest_stop = max(longest_stop, now - stopped_since)
                else:
                    stopped_since = None
                time.sleep(0.005)
        assert failures == []
        wait_for(lambda: not any(_stopped(pid) for pid in group), 10, "the builder continued once nothing is in flight")
        gate = _gate(daemon)
        assert gate["paused"] is False and gate["pauses"] >= 2, gate
        assert gate["forced_runs"] >= 2, gate  # 3 s busy, at most 1 s stopped in a row, then 0.1 s runs
        assert longest_stop < MAX_PAUSE_S + 0.5, longest_stop
        assert 0.5 < gate["paused_s"] < time.monotonic() - started, gate

        config = json.loads(daemon.config_path.read_text())
        daemon.write_config({**config, "build_yield": False})
        wait_for(lambda: any(e["event"] == "config_applied" for e in daemon.log_events()), 30, "the reload applied")
        pauses = _gate(daemon)["pauses"]
        with _busy(daemon) as failures:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                assert not _stopped(builder), "build_yield false: never stopped"
                time.sleep(0.01)
        assert failures == []
        assert _gate(daemon)["pauses"] == pauses
    finally:
        os.kill(builder, signal.SIGKILL)
        end_held_compiles(tmp_path)


def test_a_builder_stopped_when_the_supervisor_is_killed_ends_with_its_compilers(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """kill -9 of the supervisor while the gate has its builder stopped: its stop sentinel continues the group, so
    the builder, its g++ and cc1plus and the sentinel are all gone 5 s later, not stopped orphans."""
    models = {"slow": _slow_model(tmp_path)}
    daemon, builder, compilers = start_held_compile(start_daemon, tmp_path, models, oversubscribe=True)
    tree = [psutil.Process(builder), *psutil.Process(builder).children(recursive=True)]
    sentinels = [p for p in tree if os.getpgid(p.pid) != builder]
    try:
        assert len(sentinels) == 1, [(p.pid, p.name()) for p in tree]
        with _busy(daemon, timeout_s=2.0):
            wait_for(lambda: _stopped(builder), 30, "the builder stopped while requests are in flight")
            daemon.process.kill()
            daemon.process.wait()

            def gone() -> bool:
                return not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

            wait_for(gone, 5.0, "the builder's whole tree ended after the supervisor's kill -9")
    finally:
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
        end_held_compiles(tmp_path)


def test_the_gate_never_stops_a_timing_builder_and_its_floor_takes_a_share() -> None:
    """Pure clock: never paused while timing or warming up; under constant load it runs about `min_share`."""
    clock = GateClock(min_share=0.25)
    assert clock.wanted(0.0, busy=True, may_pause=False) == (GateState.RUNNING, False)
    assert clock.wanted(0.0, busy=False, may_pause=True) == (GateState.RUNNING, False)
    now, step, running = 0.0, 0.001, 0.0
    while now < 20.0:
        state, _ = clock.wanted(now, busy=True, may_pause=True)
        clock.state = state
        running += step if state is GateState.RUNNING else 0.0
        now += step
    assert 0.2 < running / now < 0.3, running / now
    never = GateClock(min_share=0.0)
    assert never.wanted(0.0, busy=True, may_pause=True)[0] is GateState.PAUSED
    assert never.wanted(30.0, busy=True, may_pause=True)[0] is GateState.PAUSED
    always = GateClock(min_share=1.0)
    assert always.wanted(0.0, busy=True, may_pause=True)[0] is GateState.RUNNING
