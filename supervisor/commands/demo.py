"""`infervisor demo`: the main job end to end — start the daemon, send real requests, report, stop."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from protocol.client import Client
from protocol.constants import CLIENT_SOCKET_NAME
from protocol.errors import InferenceError
from supervisor.commands.infer import random_inputs, summarize
from supervisor.commands.status import format_status
from supervisor.control import ControlError, control_request
from supervisor.status import percentile


def _wait_ready(process: subprocess.Popen[bytes], runtime_dir: Path, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {process.returncode} before it was ready")
        try:
            status = control_request(runtime_dir, {"cmd": "status"}, timeout=2.0)
        except ControlError:
            status = None
        if status is not None and status["state"] == "ready":
            return status
        time.sleep(0.05)
    raise RuntimeError(f"the daemon was not ready within {timeout:.0f} s")


def _load(
    endpoint: str, model: str, inputs: dict[str, Any], count: int, latencies: list[float], errors: list[str]
) -> None:
    with Client(endpoint) as client:
        for _ in range(count):
            started = time.perf_counter()
            try:
                client.infer(model, inputs, timeout=60)
            except InferenceError as exc:
                errors.append(str(exc.code))
                continue
            latencies.append((time.perf_counter() - started) * 1000.0)


def run_demo(args: argparse.Namespace) -> int:
    """Start `infervisor serve`, exercise every model, print results and latency, then stop it cleanly."""
    runtime_dir = Path(args.runtime_dir or tempfile.mkdtemp(prefix="infervisor-demo-"))
    log_path = runtime_dir.parent / f"{runtime_dir.name}.log"
    print(f"starting: infervisor serve --config {args.config} --runtime-dir {runtime_dir}  (log: {log_path})")
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "serve", "--config", args.config, "--runtime-dir", str(runtime_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            status = _wait_ready(process, runtime_dir, 300.0)
            print(f"ready in {time.monotonic() - started:.2f} s\n")
            print(format_status(status) + "\n")
            endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
            for name, model in status["models"].items():
                inputs = random_inputs(model["inputs"], 1)
                with Client(endpoint) as client:
                    first = time.perf_counter()
                    outputs, timing = client.infer_with_timing(name, inputs, timeout=60)
                    print(f"{name}: one request in {(time.perf_counter() - first) * 1000:.2f} ms (server {timing})")
                for out_name, array in outputs.items():
                    print(f"  {out_name}: {summarize(out_name, array)}")
                latencies: list[float] = []
                errors: list[str] = []
                per_client = max(1, args.requests // args.clients)
                threads = [
                    threading.Thread(target=_load, args=(endpoint, name, inputs, per_client, latencies, errors))
                    for _ in range(args.clients)
                ]
                load_started = time.perf_counter()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                elapsed = time.perf_counter() - load_started
                print(
                    f"{name}: {len(latencies)} ok, {len(errors)} errors, {args.clients} clients, {elapsed:.2f} s: "
                    f"{len(latencies) / elapsed:.1f} req/s, p50 {percentile(latencies, 50)} ms, "
                    f"p99 {percentile(latencies, 99)} ms\n"
                )
            print(format_status(control_request(runtime_dir, {"cmd": "status"})))
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            code = process.wait(60)
    print(f"\ndaemon stopped with exit code {code}")
    return 0 if code == 0 else 1
