"""The background builder and the compilers it starts run at the lowest CPU priority, for real (SCHED_IDLE)."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import STATIC_TINY_INPUTS, Daemon, model_entry, wait_for

pytestmark = pytest.mark.daemon


def test_the_builder_and_its_compilers_are_sched_idle_while_serving_workers_are_not(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A real background build of aoti on tiny, held while g++ compiles (its cc1plus reads a FIFO nobody writes):
    the builder and every g++ and cc1plus under it are SCHED_IDLE (inherited across fork and exec), the serving
    worker is SCHED_OTHER, so a build only takes CPU time serving leaves idle."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("aoti compiles with g++")
    hold = tmp_path / "held-compile.h"
    os.mkfifo(hold)
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} -include {hold} "$@"\n')
    wrapper.chmod(0o755)
    entry = model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS, outputs=["y"], profiles=["aoti", "eager"],
                        build="background")  # fmt: skip
    daemon = start_daemon({"models": {"t": entry}}, env={"CXX": str(wrapper)})
    daemon.wait_ready(timeout=120)

    def compiling() -> tuple[int, list[psutil.Process]] | None:
        builder = (daemon.status()["models"]["t"]["build"] or {}).get("pid")
        try:
            below = psutil.Process(builder).children(recursive=True) if builder else []
            compilers = [p for p in below if p.name().startswith(("g++", "cc1plus"))]
        except psutil.Error:
            return None
        names = {p.name().rstrip("-0123456789") for p in compilers}
        return (builder, compilers) if {"g++", "cc1plus"} <= names else None

    builder, compilers = wait_for(compiling, 300, "g++ and cc1plus compiling under the builder")
    try:
        worker = daemon.status()["models"]["t"]["workers"][0]["pid"]
        assert os.sched_getscheduler(worker) == os.SCHED_OTHER
        assert os.sched_getscheduler(builder) == os.SCHED_IDLE
        assert {p.name(): os.sched_getscheduler(p.pid) for p in compilers} == dict.fromkeys(
            (p.name() for p in compilers), os.SCHED_IDLE
        )
    finally:  # the held compile ends with its builder (its process group)
        os.kill(builder, signal.SIGKILL)
        for process in psutil.process_iter(["cmdline"]):
            if str(hold) in " ".join(process.info["cmdline"] or ()):
                process.kill()
