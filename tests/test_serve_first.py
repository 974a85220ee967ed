"""Serve first, optimize behind: a model answers before its build ends, and moves to the pick under load."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from infervisor.protocol import InferenceError
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import StartPhase
from infervisor.supervisor.commands.status import format_status
from infervisor.supervisor.host.event_loop import EventLoop
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.lifecycle.background_build import BackgroundBuilds, BuildState
from infervisor.supervisor.settings.config import load_config
from infervisor.supervisor.workers.child_links import ChildLinks
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.launcher import Launched
from infervisor.supervisor.workers.reaper import Reaper
from infervisor.supervisor.workers.slot import WorkerSlot
from infervisor.worker.profiles.cache import ArtifactCache, NotBuiltYet
from tests.conftest import Daemon, model_entry, notify_messages, wait_for
from tests.gated_models import GATE_ENV, GATED_INPUTS, expected
from tests.held_compile import end_held_compiles, start_held_compile

GATED = {"python": "tests.gated_models:gated"}
#: The load's bound: it stops at this many requests even if the test forgot to stop it.
_MAX_REQUESTS = 200_000


class SteadyClient:
    """One client sending back to back until stopped; counts what it sent, what came back, and every error."""

    def __init__(self, daemon: Daemon, inputs: dict[str, np.ndarray], want: np.ndarray) -> None:
        self.daemon, self.inputs, self.want = daemon, inputs, want
        self.sent = self.answered = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with self.daemon.client() as client:
            while not self.stop.is_set() and self.sent < _MAX_REQUESTS:
                self.sent += 1
                try:
                    got = client.infer("g", self.inputs, timeout=60)["y"]
                except InferenceError as exc:
                    self.errors.append(f"{exc.code}: {exc.message}")
                    continue
                self.answered += 1
                if not np.allclose(got, self.want, rtol=1e-4, atol=1e-5):
                    self.errors.append(f"wrong answer {got} for {self.want}")

    def __enter__(self) -> SteadyClient:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(90)


def _model(daemon: Daemon) -> dict[str, Any]:
    model: dict[str, Any] = daemon.status()["models"]["g"]
    return model


def test_answers_before_the_build_ends_survives_a_killed_builder_and_switches_under_load(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The worker serves eager while the builder waits on the gate; status says building jit 1 of 2, serving eager,
    not failed; the builder killed -9 starts again; once the gate opens the worker moves to jit under a steady
    client with no error and no lost request."""
    gate = tmp_path / "gate"
    config = {"models": {"g": model_entry(GATED, GATED_INPUTS, profiles=["jit", "eager"], outputs=["y"],
                                       build="background")}}  # fmt: skip
    daemon = start_daemon(config, env={GATE_ENV: str(gate)})
    (worker,) = daemon.wait_ready(timeout=60)["models"]["g"]["workers"]
    assert worker["profile"] == "eager", worker
    assert any("jit: needs a build" in note for note in worker["profile_skipped"]), worker
    x = np.random.default_rng(38).standard_normal((2, 8)).astype(np.float32)
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("g", {"x": x}, timeout=30)["y"], expected(x), rtol=1e-4, atol=1e-5)

    def building_jit() -> dict[str, Any] | None:
        model = _model(daemon)
        build = model["build"] or {}
        ok = build.get("state") == "building" and build.get("profile") == "jit" and build.get("phase") == "building"
        return model if ok else None

    model = wait_for(building_jit, 60, "the builder on jit")
    assert (model["build"]["index"], model["build"]["count"]) == (1, 2), model["build"]
    assert model["health"] == "serving" and model["serving"] == ["eager"], model
    assert "optimizing: building jit (1 of 2)" in format_status(daemon.status())
    assert "failed" not in format_status(daemon.status())
    metrics = daemon.control({"cmd": "metrics"})["text"]
    for line in (
        'infervisor_model_build_state{model="g",state="building"} 1.0',
        'infervisor_model_build_profile_index{model="g"} 1.0',
        'infervisor_workers_serving_profile{model="g",profile="eager"} 1.0',
    ):
        assert line in metrics, line

    # kill -9 of the builder mid-build: another one starts and builds jit again (a first SIGKILL is not a crash).
    first_pid = model["build"]["pid"]
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == "zombie", 30, "gone")
    restarted = wait_for(
        lambda: (b := (building_jit() or {}).get("build")) and b["attempts"] == 2 and b["pid"] != first_pid and b,
        60,
        "a second builder on jit",
    )
    assert restarted["refused"] == {}, restarted

    with SteadyClient(daemon, {"x": x}, expected(x)) as load:
        wait_for(lambda: load.answered > 20, 60, "answers before the switch")
        gate.touch()

        def switched() -> bool:
            workers = [w for w in _model(daemon)["workers"] if "role" not in w]
            return bool(workers) and all(w["state"] == "serving" and w["profile"] == "jit" for w in workers)

        wait_for(switched, 120, "the worker serving jit")
        answered = load.answered
        wait_for(lambda: load.answered > answered + 20, 60, "answers after the switch")
    assert load.errors == [] and load.sent == load.answered > 40, (load.sent, load.answered, load.errors[:3])
    model = _model(daemon)
    assert model["build"]["state"] == "done" and model["build"]["picked"] == "jit", model["build"]
    assert model["serving"] == ["jit"] and model["health"] == "serving"


def _group(leader: int) -> list[psutil.Process]:
    """The live processes of the process group `leader` led (zombies are dead already)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == leader and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (psutil.Error, ProcessLookupError):
            continue
    return members


def test_a_builder_killed_while_it_compiles_takes_its_compilers_with_it(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """kill -9 of a background builder while g++ compiles for aoti: no g++ or cc1plus of its process group (nor any
    other process of it) is alive shortly after. The compile is held in flight: the real g++ is told to include a
    FIFO nobody writes, so its cc1plus waits there until it is killed."""
    _, builder, compilers = start_held_compile(start_daemon, tmp_path)
    try:
        os.kill(builder, signal.SIGKILL)
        wait_for(lambda: not _group(builder), 10, "every process of the killed builder's group gone")
        assert not [p for p in compilers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:  # what a daemon that leaves them running left behind: ours alone name the FIFO
        end_held_compiles(tmp_path)


def test_a_worker_serving_first_never_builds_nor_waits_and_loads_only_verified_packages(tmp_path: Path) -> None:
    """Ready-only: a missing package, one another process is building (lock held) and one failing its digest are
    NotBuiltYet at once with the reason, nothing is built; a whole package is loaded."""
    cache = ArtifactCache(tmp_path)
    key = {"k": 38}
    path = cache.path_for("aoti", key)
    built: list[Path] = []

    def build(target: Path) -> None:
        built.append(target)
        target.write_bytes(b"package" + bytes(64))

    cache.ready_only = True
    with pytest.raises(NotBuiltYet, match="is not built yet"):
        cache.fetch(path, key, build, Path.read_bytes)
    cache.ready_only = False
    cache.fetch(path, key, build, Path.read_bytes)
    cache.ready_only = True
    assert cache.fetch(path, key, build, Path.read_bytes).hit and len(built) == 1
    with path.with_suffix(".lock").open("a") as lock:  # another process's build of the same key
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(NotBuiltYet, match="being built by another process"):
            cache.fetch(path, key, build, Path.read_bytes)
        fcntl.flock(lock, fcntl.LOCK_UN)
    path.write_bytes(b"half a package")  # as a build killed mid-write would, had it not gone to a temp file first
    with pytest.raises(NotBuiltYet, match="sha256"):
        cache.fetch(path, key, build, Path.read_bytes)
    assert not path.exists() and len(built) == 1 and cache.builds == 1


def test_a_start_that_builds_before_ready_extends_systemds_start_timeout(
    start_daemon: Callable[..., Daemon], tmp_path: Path, notify_socket: socket.socket
) -> None:
    """With `build: at_start` the worker builds before READY: EXTEND_TIMEOUT_USEC reaches systemd while it does, and
    READY=1 only once the gate lets the build finish."""
    gate = tmp_path / "gate"
    entry = model_entry(GATED, GATED_INPUTS, profiles=["jit", "eager"], outputs=["y"], build="at_start")
    env = {GATE_ENV: str(gate), "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    daemon = start_daemon({"models": {"g": entry}}, env=env)
    seen: list[str] = []
    notify_messages(notify_socket, lambda got: any("EXTEND_TIMEOUT_USEC=" in m for m in got), 60, seen)
    wait_for(lambda: (s := daemon.try_status()) and s["models"]["g"]["workers"][0].get("starting"), 60, "starting")
    assert not any("READY=1" in m for m in seen), seen
    gate.touch()
    notify_messages(notify_socket, lambda got: any("READY=1" in m for m in got), 120, seen)
    (worker,) = daemon.wait_ready(timeout=30)["models"]["g"]["workers"]
    assert worker["profile"] == "jit" and daemon.status()["models"]["g"]["build"] is None


def test_the_demo_answers_first_then_shows_the_switch_without_building_before_it_starts(tmp_path: Path) -> None:
    """`infervisor demo` on a model to optimize: no build before the daemon starts, the first load on eager, then
    the builder's progress, the switch, and the same load on jit."""
    gate = tmp_path / "gate"
    gate.touch()
    entry = model_entry(GATED, GATED_INPUTS, profiles=["jit", "eager"], outputs=["y"], build="background")
    (tmp_path / "demo.json").write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"g": entry}}))
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "demo", "--config", "demo.json", "--requests", "10"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
        env={**os.environ, GATE_ENV: str(gate)},
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    out = done.stdout
    assert "infervisor build" not in out and "building the compiled packages" not in out, out
    before, _, after = out.partition("switched to the builder's pick after ")
    assert after, out
    assert "serves eager" in before and "(10 ok, 0 errors" in before, before
    assert "serves jit; optimized: picked jit" in after and "(10 ok, 0 errors" in after, after


class _Ended:
    """A builder process that has ended with `code` (the builder reads only poll, pid, kill and wait)."""

    def __init__(self, pid: int, code: int) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code

    def kill(self) -> None:
        """Already ended."""

    def wait(self, timeout: float | None = None) -> int:
        return self.code


def test_a_builder_killed_once_on_a_profile_builds_it_again_and_twice_refuses_it(tmp_path: Path) -> None:
    """The builder's record of each end: a first SIGKILL on jit is passed on as an interruption (jit built again),
    a second as a crash (the next builder refuses jit); a builder that ends 0 with the pick served switches
    nothing, one whose pick differs asks for the rolling switch."""
    path = tmp_path / "config.json"
    entry = model_entry({"builtin": "tiny"}, [{"name": "x", "dtype": "float32", "shape": [None, 16]}],
                        profiles=["jit", "eager"], build="background")  # fmt: skip
    path.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"tiny": entry}}))
    config = load_config(path)
    slot = WorkerSlot(config.models["tiny"], Assignment("tiny", 0, (0,), 0, 1, False))
    codes = [-signal.SIGKILL, -signal.SIGKILL, 0]
    launched: list[list[dict[str, Any]]] = []
    switched: list[str] = []

    def launcher(model: Any, assignment: Assignment, config: Any, exits: Any, **_: Any) -> Launched:
        launched.append([dict(e) for e in exits])
        return Launched(_Ended(100 + len(launched), codes[len(launched) - 1]), None, "tiny.build")

    reaper = Reaper()
    children = Children(reaper, ChildLinks(EventLoop(), Anomalies()))
    switch = lambda m, why: switched.append(why)  # noqa: E731
    builds = BackgroundBuilds(lambda: config, lambda name: [slot], switch, children, launcher)
    assert builds.serves_first(config.models["tiny"])
    builds.tick(1.0, lambda name: ["eager"])
    build = builds.build_of("tiny")
    assert build is not None and build.state is BuildState.BUILDING and len(launched) == 1
    on_jit = wm.Progress(StartPhase.BUILDING.value, "jit", 1, 2, 0.0, "")
    for turn in (2.0, 3.0):
        builds.take(build, on_jit, turn)
        assert reaper.reap(turn) == 1
        builds.tick(turn, lambda name: ["eager"])
    assert [e["killed_by_supervisor"] for e in launched[-1]] == [True, False] and len(launched) == 3
    builds.take(build, wm.Ready("b", 1, 0.0, 0.0, 1, [0], "eager", [], []), 4.0)
    reaper.reap(4.0)
    builds.tick(4.0, lambda name: ["eager"])
    assert build.state is BuildState.DONE and build.picked == "eager" and switched == []
    assert not builds.serves_first(config.models["tiny"])
    build.state, codes[2] = BuildState.BUILDING, 0
    process = _Ended(9, 0)
    build.child.adopt(process, None, "b", (0,), 5.0)
    reaper.watch(process, lambda code, now: build.child.reaped(process, code))
    build.picked = "jit"
    reaper.reap(5.0)
    builds.tick(5.0, lambda name: ["eager"])
    assert switched == ["background build done: switching to jit"]
