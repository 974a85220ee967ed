"""The OIP gateway's throughput beside the ZeroMQ path, on one daemon in one run.

    python bench/oip.py [--model tiny] [--clients 8] [--rounds 3] [--seconds 5] [--json out.json]

One daemon serves `--model` with `oip` on two loopback ports. `--clients` closed-loop client threads drive it over
each arm in turn, alternating `--rounds` times (ZeroMQ, OIP gRPC, OIP HTTP with binary tensors), `--seconds` a
window: req/s and P50/P99 of the round trip per window; the summary is each OIP arm's median over the rounds of its
req/s divided by that round's ZeroMQ req/s (targets: gRPC >= 0.6, HTTP binary >= 0.4 on tiny). The load average
is printed before and after: this box is shared.

Each window also reads the CPU time every process spent on it, per request: the client threads (this process), the
supervisor, the workers and the gateway. A fourth arm, `grpc_floor`, drives bench/grpc_floor.py (grpcio's
asyncio server answering a constant, no daemon behind it) the same way: its CPU per request is what the gRPC
library alone costs, the least any gateway on it can. When the clients share the daemon's cores, req/s follows the
whole box's CPU per request, so those columns say where a ratio's limit is.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402

from bench.daemon import SHAPES, builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client import Client  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

Call = Callable[[np.ndarray[Any, Any]], Any]
ARMS = ("zeromq", "grpc", "http_binary", "grpc_floor")
#: What each process of the daemon is, from its command line (first match).
_KINDS = (
    ("infervisor.gateway", "gateway"),
    ("infervisor.worker.template", "template"),
    ("infervisor.worker", "workers"),
)


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def caller(arm: str, model: str, name: str, endpoints: dict[str, str]) -> tuple[Call, Callable[[], None]]:
    """One client of `arm`: the call it makes per request, and how to close it."""
    if arm == "zeromq":
        zmq_client = Client(endpoints["zeromq"])
        return (lambda x: zmq_client.infer(model, {name: x}, timeout=60.0)), zmq_client.close
    if arm in ("grpc", "grpc_floor"):
        grpc_client = grpcclient.InferenceServerClient(endpoints[arm])

        def grpc_call(x: np.ndarray[Any, Any]) -> Any:
            tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            return grpc_client.infer(model, [tensor], client_timeout=60.0)

        return grpc_call, grpc_client.close
    http_client = httpclient.InferenceServerClient(endpoints["http"], network_timeout=60.0)

    def http_call(x: np.ndarray[Any, Any]) -> Any:
        tensor = httpclient.InferInput(name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        return http_client.infer(model, [tensor])

    return http_call, http_client.close


def cpu_by_kind(processes: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """CPU seconds (user + system, every thread) each kind of process has used so far."""
    totals: dict[str, float] = {}
    for kind, members in processes.items():
        totals[kind] = 0.0
        for process in members:
            try:
                times = process.cpu_times()
            except psutil.Error:  # it exited; a window it ended in is marked by the respawn anyway
                continue
            totals[kind] += times.user + times.system
    return totals


def daemon_processes(supervisor: int, floor: int) -> dict[str, list[psutil.Process]]:
    """The bench's own process, the supervisor, its children by kind, and the floor server."""
    kinds: dict[str, list[psutil.Process]] = {"client": [psutil.Process()], "supervisor": [psutil.Process(supervisor)]}
    for child in psutil.Process(supervisor).children(recursive=True):
        title = " ".join(child.cmdline())
        kind = next((k for module, k in _KINDS if module in title), "other")
        kinds.setdefault(kind, []).append(child)
    kinds["floor"] = [psutil.Process(floor)]
    return kinds


def drive(
    arm: str,
    model: str,
    endpoints: dict[str, str],
    seconds: float,
    clients: int,
    processes: dict[str, list[psutil.Process]] | None = None,
) -> dict[str, Any]:
    """req/s, P50 and P99 (ms) of `clients` closed-loop clients of `arm` over `seconds`, and with `processes` the
    CPU microseconds each kind of them spent per request."""
    name, shape = SHAPES[model]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop_at = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        x = np.random.default_rng(index).standard_normal(shape).astype(np.float32)
        call, close = caller(arm, model, name, endpoints)
        try:
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                call(x)
                latencies[index].append((time.perf_counter() - started) * 1000.0)
        finally:
            close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    cpu_before = cpu_by_kind(processes or {})
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [ms for own in latencies for ms in own]
    elapsed = time.monotonic() - started
    cpu_after = cpu_by_kind(processes or {})
    cpu_us = {k: round((cpu_after[k] - cpu_before[k]) / max(len(every), 1) * 1e6) for k in cpu_after}
    return {
        "arm": arm,
        "req_s": round(len(every) / elapsed, 1),
        "p50_ms": round(percentile(every, 50) or 0.0, 3),
        "p99_ms": round(percentile(every, 99) or 0.0, 3),
        "cpu_us_per_request": {k: us for k, us in cpu_us.items() if us > 0},
    }


def wait_for_gateway(runtime: Path, http_at: str, model: str) -> None:
    """Until the gateway says `model` is ready (a minute at most)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpclient.InferenceServerClient(http_at).is_model_ready(model):
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.2)
    endpoints = control_request(runtime, {"cmd": "status"})["endpoints"]
    raise SystemExit(f"the gateway did not call {model} ready: {endpoints}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    http_at, grpc_at = f"127.0.0.1:{_port()}", f"127.0.0.1:{_port()}"
    config = {"oip": {"http": http_at, "grpc": grpc_at}, "models": {args.model: builtin_entry(args.model)}}
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="oip-bench-") as folder:
        runtime = Path(folder) / "run"
        # This checkout's code in the daemon's children too (the gateway and workers start with -P).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        process = start_daemon(config, runtime, env={**os.environ, "PYTHONPATH": path})
        floor_at = f"127.0.0.1:{_port()}"
        floor = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "grpc_floor.py"), floor_at], stdout=subprocess.PIPE
        )
        endpoints = {"zeromq": f"ipc://{runtime / CLIENT_SOCKET_NAME}", "grpc": grpc_at, "http": http_at,
                     "grpc_floor": floor_at}  # fmt: skip
        try:
            wait_for_gateway(runtime, http_at, args.model)
            if floor.stdout is None or floor.stdout.readline() != b"serving\n":
                raise SystemExit("bench/grpc_floor.py did not start")
            for arm in ARMS:  # warm every path once, outside the windows
                drive(arm, args.model, endpoints, 1.0, args.clients)
            for round_index in range(args.rounds):
                processes = daemon_processes(process.pid, floor.pid)
                for arm in ARMS:
                    row = {
                        "round": round_index,
                        **drive(arm, args.model, endpoints, args.seconds, args.clients, processes),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            floor.kill()
            floor.wait(60)
            process.terminate()
            process.wait(60)
    summary: dict[str, Any] = {"model": args.model, "clients": args.clients, "load_before": load_before}
    for arm in ARMS[1:]:
        ratios = [
            next(r for r in rows if r["round"] == i and r["arm"] == arm)["req_s"]
            / next(r for r in rows if r["round"] == i and r["arm"] == "zeromq")["req_s"]
            for i in range(args.rounds)
        ]
        summary[f"{arm}_vs_zeromq"] = round(statistics.median(ratios), 3)
    for arm in ARMS:
        own = [r["cpu_us_per_request"] for r in rows if r["arm"] == arm]
        kinds = sorted({k for row in own for k in row})
        summary[f"{arm}_cpu_us_per_request"] = {k: statistics.median(row.get(k, 0) for row in own) for k in kinds}
    summary["load_after"] = os.getloadavg()
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
