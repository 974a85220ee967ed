"""Every child process forked from the warm template and reaped by the supervisor (workers, builders, audit
processes); the template killed, stale, broken or switched off: children exec'd or forked again, as status says."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from infervisor.protocol.constants import WorkerExitCode
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for

TINY = model_entry({"builtin": "tiny"}, TINY_INPUTS)
#: jit serves at once (built at the start), so its answers are audited: an audit process.
AUDITED = {**TINY, "profiles": ["jit", "eager"], "pick": "first", "audit": {"budget": 0.5}}
#: A fastest pick of two profiles, in the background: a builder.
BUILT = {**TINY, "profiles": ["jit", "eager"], "pick": "fastest", "build": "background"}


def _started(daemon: Daemon) -> list[dict[str, Any]]:
    """The daemon's `child_started` log events."""
    return [e for e in daemon.log_events() if e["event"] == "child_started"]


def _answer(daemon: Daemon) -> np.ndarray:
    with daemon.client() as client:
        return client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, timeout=30.0)["y"]


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def test_workers_builders_and_audit_processes_are_forks_of_the_template_adopted_by_the_supervisor(
    start_daemon: Callable[..., Daemon],
) -> None:
    """A worker, the background builder and the audit process all start as forks of one warm template, each a child
    of the supervisor (its parent and reaper), with a title naming its module and id; none is exec'd."""
    daemon = start_daemon({"oversubscribe": True, "models": {"tiny": AUDITED, "built": BUILT}})
    daemon.wait_ready()

    def every_kind_started() -> bool:
        _answer(daemon)  # traffic for the audit to sample: it starts its process on the first sample of jit
        started = _started(daemon)
        kinds = {e["entry"] for e in started}
        builder = any(".build." in e["child"] for e in started)
        return {"infervisor.worker", "infervisor.worker.audit"} <= kinds and builder

    wait_for(every_kind_started, 120, "a worker, a builder and an audit process started", interval=0.2)
    started = _started(daemon)
    assert {e["start"] for e in started} == {"forked"}, started
    template = daemon.status()["template"]
    assert template["state"] == "warm" and template["execed"] == 0 and template["forked"] >= 3, template
    worker = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
    assert _parent(worker) == daemon.process.pid
    title = psutil.Process(worker).cmdline()[0]
    assert "-m infervisor.worker tiny.0." in title, title


def test_a_killed_template_is_replaced_and_workers_serve_on(start_daemon: Callable[..., Daemon]) -> None:
    """kill -9 of the template costs no answer; a new template is warm and the next worker (after a kill -9)
    is forked from it, answers the same, and is the supervisor's child."""
    daemon = start_daemon({"models": {"tiny": TINY}})
    daemon.wait_ready()
    before = _answer(daemon)
    first = daemon.status()["template"]
    os.kill(first["pid"], signal.SIGKILL)
    assert np.array_equal(_answer(daemon), before)
    second = wait_for(lambda: (t := daemon.status()["template"])["state"] == "warm" and t["pid"] != first["pid"]
                      and t, 60, "a second template warm")  # fmt: skip
    worker = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: (w := daemon.status()["models"]["tiny"]["workers"][0])["pid"] != worker
             and w["state"] == "serving", 60, "the worker back")  # fmt: skip
    assert np.array_equal(_answer(daemon), before)
    now = daemon.status()
    assert now["template"]["forked"] == second["forked"] + 1 and now["template"]["execed"] == 0, now["template"]
    assert _parent(now["models"]["tiny"]["workers"][0]["pid"]) == daemon.process.pid
    events = [e for e in daemon.log_events() if e["event"] == "warm_template_down"]
    assert events and "SIGKILL" in events[0]["reason"], events


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """A copy of the package a daemon runs from (its PYTHONPATH and working folder), to change on disk."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "infervisor", tree / "infervisor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def _daemon_from(tree: Path, tmp: Path, config: dict[str, Any]) -> Daemon:
    tmp.mkdir()
    return Daemon(tmp, config, env={"PYTHONPATH": str(tree)}, cwd=tree)


def test_a_stale_template_is_replaced_and_the_child_meanwhile_is_execd(package_copy: Path, tmp_path: Path) -> None:
    """An edit of the package on disk after the template started: the next child is exec'd (it runs the new code),
    a new template starts, and the child after that is forked from it."""
    daemon = _daemon_from(package_copy, tmp_path / "d", {"models": {"tiny": TINY}})
    try:
        daemon.wait_ready()
        first = daemon.status()["template"]
        assert first["state"] == "warm", first
        edited = package_copy / "infervisor" / "worker" / "loop.py"
        edited.write_text(edited.read_text() + "\n# changed on disk\n")
        for round_ in range(2):
            worker = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
            if round_ == 1:  # the replacement must be warm before the next child can be its fork
                wait_for(lambda: daemon.status()["template"]["state"] == "warm", 60, "the new template warm")
            os.kill(worker, signal.SIGKILL)
            wait_for(lambda worker=worker: (w := daemon.status()["models"]["tiny"]["workers"][0])["pid"] != worker
                     and w["state"] == "serving", 60, "the worker back")  # fmt: skip
        starts = [e["start"] for e in _started(daemon)]
        assert starts == ["forked", "exec", "forked"], starts
        template = daemon.status()["template"]
        assert template["started"] == 2 and template["pid"] != first["pid"], template
    finally:
        daemon.stop()


def test_a_template_that_cannot_start_leaves_children_execd_and_says_why(package_copy: Path, tmp_path: Path) -> None:
    """A template whose import fails: workers are exec'd and serve; status says the template is down and why, and
    each later start waits twice as long as the one before."""
    template = package_copy / "infervisor" / "worker" / "template.py"
    template.write_text('raise ImportError("a broken template for the test")\n')
    daemon = _daemon_from(package_copy, tmp_path / "d", {"models": {"tiny": TINY}})
    try:
        daemon.wait_ready()
        _answer(daemon)
        status = daemon.status()["template"]
        assert status["state"] == "down" and "children are exec'd" in status["why"], status
        assert [e["start"] for e in _started(daemon)] == ["exec"]
        worker = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
        assert "infervisor.worker" in psutil.Process(worker).cmdline()
        # Each failed start waits twice as long as the last: a template that cannot start costs the box little.
        waits = wait_for(lambda: _downs(daemon)[1:] and _downs(daemon), 60, "a second failed template start")
        assert waits[:2] == [5.0, 10.0], waits
    finally:
        daemon.stop()


def _downs(daemon: Daemon) -> list[float]:
    return [e["restart_in_s"] for e in daemon.log_events() if e["event"] == "warm_template_down"]


def test_warm_template_false_execs_every_child(start_daemon: Callable[..., Daemon]) -> None:
    """`warm_template: false`: no template process, each worker a fresh interpreter, and status says so."""
    daemon = start_daemon({"warm_template": False, "models": {"tiny": TINY}})
    daemon.wait_ready()
    status = daemon.status()["template"]
    assert status["state"] == "off" and status["pid"] is None and "warm_template is false" in status["why"]
    worker = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
    assert psutil.Process(worker).cmdline()[:4] == [sys.executable, "-P", "-m", "infervisor.worker"]
    assert daemon.worker_pids() == [worker]


def test_a_forked_child_adopted_by_neither_the_supervisor_nor_its_middle_exits_at_once() -> None:
    """A child whose middle exited and whose supervisor died before its first look exits at once, not after the wait."""
    code = (
        "import os, sys, time\n"
        "from infervisor.worker.template import await_supervisor\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    await_supervisor(supervisor_pid=os.getppid() + 1, middle_pid=os.getppid() + 2)\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, round(time.monotonic() - started, 3))\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    exit_code, waited_s = result.stdout.split()
    assert int(exit_code) == WorkerExitCode.SUPERVISOR_LOST, result.stderr
    assert float(waited_s) < 1.0, waited_s
