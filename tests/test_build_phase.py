"""The build phase: progress before READY, its own limit per profile, resumable, and `infervisor build` ahead of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, Daemon, model_entry, wait_for
from tests.fault_models import FAULT_INPUTS, SLOW_TRACE_FLAG

SLOW = {"python": "tests.fault_models:slow_when_traced"}
FAULTY = {"python": "tests.fault_models:faulty"}
ENV = {"PYTHONPATH": str(ROOT)}
#: One static shape: aoti compiles one package (no batch buckets), the one the daemon then loads.
STATIC_INPUTS = [{"name": "x", "dtype": "float32", "shape": [1, 2]}]


def _config(cache: Path) -> dict[str, Any]:
    return {
        "cache_dir": str(cache),
        "oversubscribe": True,
        # Short enough to kill the slow trace (120 s), long enough for loading a cached package.
        "compile_timeout_s": 8,
        "worker_start_timeout_s": 240,
        "models": {
            "slow": model_entry(SLOW, STATIC_INPUTS, profiles=["jit", "aoti", "eager"]),
            # Its forward branches on an input value: torch.export refuses it at once.
            "bad": model_entry(FAULTY, FAULT_INPUTS, profiles=["aoti", "eager"]),
        },
    }


def _build(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "build.json"
    path.write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "infervisor", "build", "--config", str(path), "--json", str(tmp_path / "built.json")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=900, check=False,
    )  # fmt: skip


def test_build_fills_the_cache_then_a_start_loads_it_and_kills_a_slow_build_at_its_own_limit(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """`infervisor build` compiles aoti and names the profile that failed; the daemon then loads that package, kills
    a build over compile_timeout_s twice (never recorded as a crash), and skips it with the reason."""
    config = _config(tmp_path / "cache")
    done = _build(config, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "slow [" in done.stdout and "jit: building" in done.stdout, done.stdout
    assert "aoti (package 1 of 1): passed\n    compiled and cached package aoti-" in done.stdout, done.stdout
    assert "bad aoti: aoti failed to build: torch.export failed" in done.stderr, done.stderr
    built = json.loads((tmp_path / "built.json").read_text())["profiles"]
    outcomes = {(row["model"], row["profile"]): row["outcome"] for row in built}
    # pick first: `slow` stops at jit like its worker would, then builds the packaged rest of its chain (aoti);
    # `bad` falls to eager as its worker would.
    assert outcomes == {
        ("slow", "jit"): "passed", ("slow", "aoti"): "passed", ("bad", "aoti"): "failed", ("bad", "eager"): "passed"
    }, built  # fmt: skip
    assert len(list((tmp_path / "cache").glob("aoti-*.pt2"))) == 1, "the one package of the static shape"
    assert list((tmp_path / "cache").glob("aoti-*.failed")), "the failed build is remembered for the daemon"

    flag = tmp_path / "slow-trace"
    flag.touch()  # from now on tracing `slow` takes 120 s: longer than the compile limit
    daemon = start_daemon(config, env={**ENV, SLOW_TRACE_FLAG: str(flag)})

    def building_jit() -> dict[str, Any] | None:
        status = daemon.try_status()
        workers = status["models"]["slow"]["workers"] if status else []
        starting = workers[0].get("starting") if workers else None
        return starting if starting and starting["phase"] == "building" and starting["profile"] == "jit" else None

    starting = wait_for(building_jit, 120, "the slow model's worker reporting its jit build")
    assert (starting["index"], starting["count"]) == (1, 3), starting
    status = daemon.wait_ready(timeout=300)
    (worker,) = status["models"]["slow"]["workers"]
    assert worker["profile"] == "aoti", worker
    assert any("overran the compile limit 2 times" in note for note in worker["profile_skipped"]), worker
    assert any(note.startswith("loaded cached package aoti-") for note in worker["profile_build"]), worker
    assert worker["restarts"] == 2, worker
    overruns = [e for e in daemon.log_events() if e["event"] == "worker_start_overrun"]
    assert [e["profile"] for e in overruns] == ["jit", "jit"], overruns
    assert all("building profile jit (1 of 3)" in e["reason"] and "compile_timeout_s (8 s)" in e["reason"]
               for e in overruns), overruns  # fmt: skip
    phases = [
        (e["phase"], e.get("profile")) for e in daemon.log_events() if e["event"] == "worker_phase" and "slot" in e
    ]
    assert ("building", "aoti") in phases and ("warming up", "aoti") in phases, phases
    # Killed by the supervisor's limit: the next workers tried jit again instead of recording a crash.
    assert not list((tmp_path / "cache" / "attempts").glob("*.crashed"))
    (bad,) = status["models"]["bad"]["workers"]
    assert bad["profile"] == "eager" and "torch.export failed" in bad["profile_skipped"][0], bad
