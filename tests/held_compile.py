"""A real background build of aoti on tiny held while g++ compiles: its cc1plus waits on a FIFO nobody writes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import STATIC_TINY_INPUTS, Daemon, model_entry, wait_for


def start_held_compile(
    start_daemon: Callable[..., Daemon], folder: Path, models: dict[str, Any] | None = None, **settings: Any
) -> tuple[Daemon, int, list[psutil.Process]]:
    """A daemon serving model `t` (beside `models`, with the top-level `settings`) whose background builder is
    compiling: (the daemon, the builder's pid, its g++ and cc1plus). The real g++ is told to include a FIFO in
    `folder`, so the compile stays in flight until killed."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("aoti compiles with g++")
    hold = folder / "held-compile.h"
    os.mkfifo(hold)
    wrapper = folder / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} -include {hold} "$@"\n')
    wrapper.chmod(0o755)
    entry = model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS, outputs=["y"], profiles=["aoti", "eager"],
                        build="background")  # fmt: skip
    daemon = start_daemon({**settings, "models": {"t": entry, **(models or {})}}, env={"CXX": str(wrapper)})
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
    return daemon, builder, compilers


def end_held_compiles(folder: Path) -> None:
    """Kill whatever still reads the FIFO of `folder` (a compile whose builder's group outlived the test)."""
    hold = str(folder / "held-compile.h")
    for process in psutil.process_iter(["cmdline"]):
        if hold in " ".join(process.info["cmdline"] or ()):
            process.kill()
