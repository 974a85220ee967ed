"""optimize's final check: the chosen chain and layout served by a real daemon, under probe's own paced load.

In process there is no broker hop, no reply path and no supervisor competing for the cores, so
the in-process P99 is not what `infervisor probe` later sees against the served model. The check
starts `infervisor serve` on the config as it would be written, offers the QPS the promise is
made for with the same load generator probe uses, and reports that P99: the one optimize promises.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.supervisor.core.control import DaemonNotReady, await_status
from infervisor.supervisor.toolkit.inputs import random_inputs
from infervisor.supervisor.toolkit.load import closed_loop, paced_load
from infervisor.supervisor.toolkit.probe import quantile


class CheckFailed(Exception):
    """The daemon did not start, or the model never served; the message says why."""


@dataclass(frozen=True)
class DaemonCheck:
    """What the served model did under the paced load, and at saturation."""

    qps: float
    clients: int
    seconds: float
    samples: int
    errors: int
    p50_ms: float
    p99_ms: float
    #: Requests per second the daemon answered with `2 x workers` clients sending back to back.
    saturated_qps: float
    #: The profile each worker serves.
    profiles: list[str]


def _wait_serving(process: subprocess.Popen[bytes], runtime_dir: Path, model: str, timeout: float) -> list[str]:
    """The profiles of the model's workers once every one of them serves."""

    def profiles(status: dict[str, Any]) -> list[str] | None:
        workers = status.get("models", {}).get(model, {}).get("workers", [])
        if workers and all(w["state"] == "serving" for w in workers):
            return [str(w["profile"]) for w in workers]
        return None

    try:
        return await_status(process, runtime_dir, profiles, timeout, f"{model} was not served by every worker")
    except DaemonNotReady as exc:
        raise CheckFailed(str(exc)) from None


def serving_config(raw: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    """The config as written, made safe to run beside a serving daemon: its own sockets, the measured cache."""
    config = {**raw, "cache_dir": str(cache_dir), "log_level": "warning"}
    for key in ("runtime_dir", "tcp_endpoint", "curve"):  # a second daemon must not take the first one's endpoints
        config.pop(key, None)
    return config


def check(
    raw: dict[str, Any], model: str, cache_dir: Path, qps: float | None, clients: int, seconds: float, timeout: float
) -> DaemonCheck:
    """Serve `raw` (a config, every path absolute), saturate `model`, then offer it `qps` as probe would.

    Without a QPS, half of what the daemon sustained: a load it serves with room to spare.
    """
    tmp = Path(tempfile.mkdtemp(prefix="infervisor-optimize-"))
    (tmp / "config.json").write_text(json.dumps(serving_config(raw, cache_dir)))
    runtime_dir = tmp / "run"
    with (tmp / "daemon.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "infervisor", "serve", "--config", str(tmp / "config.json"),
             "--runtime-dir", str(runtime_dir)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        profiles = _wait_serving(process, runtime_dir, model, timeout)
        entry = raw["models"][model]
        inputs = random_inputs(entry["inputs"], 1)
        endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
        # Warm the request path (sockets, first replies) as a daemon serving for a while has it.
        closed_loop(endpoint, model, inputs, 1, 1.0)
        answered, _ = closed_loop(endpoint, model, inputs, 2 * int(entry.get("workers", 1)), seconds)
        qps = qps or max(1.0, round(answered / seconds / 2.0, 1))
        samples, errors = paced_load(endpoint, model, inputs, qps, seconds, clients)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if not samples:
        raise CheckFailed(f"no request succeeded under {qps:g} QPS ({errors} errors)")
    trips = [s.stages()["round_trip"] for s in samples]
    return DaemonCheck(
        qps, clients, seconds, len(samples), errors, round(quantile(trips, 50), 3), round(quantile(trips, 99), 3),
        round(answered / seconds, 1), profiles,
    )  # fmt: skip
