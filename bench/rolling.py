"""Rolling-restart benchmark: steady load, restart every worker in turn, then force another by editing config.json.

    python bench/rolling.py [--model resnet18] [--workers 2] [--clients 8] [--settle 8]

Prints failed requests, p50/p99 before, during and after each rollout, and the fewest serving workers seen.
Targets: 0 failed; p99 during <= 2x before; fewest >= N-1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import SHAPES, builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client import Client  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.protocol.errors import InferenceError  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402


class Recorder:
    """Client threads that log (finish time, latency, ok) for every request."""

    def __init__(self, endpoint: str, model: str, clients: int) -> None:
        name, shape = SHAPES[model]
        self.inputs = {name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        self.endpoint, self.model = endpoint, model
        self.samples: list[tuple[float, float, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        with Client(self.endpoint) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    client.infer(self.model, self.inputs, timeout=120)
                    outcome = "OK"
                except InferenceError as exc:
                    outcome = str(exc.code)
                with self.lock:
                    self.samples.append((time.monotonic(), (time.perf_counter() - started) * 1000.0, outcome))

    def window(self, start: float, end: float) -> list[tuple[float, float, str]]:
        """Samples that finished inside [start, end)."""
        with self.lock:
            return [s for s in self.samples if start <= s[0] < end]


def fewest_serving(runtime_dir: Path, model: str, until: threading.Event, out: list[int]) -> None:
    """Poll status and keep the smallest number of serving pool workers seen."""
    while not until.is_set():
        workers = control_request(runtime_dir, {"cmd": "status"})["models"][model]["workers"]
        out[0] = min(out[0], sum(1 for w in workers if w["state"] == "serving" and "role" not in w))
        time.sleep(0.02)


def wait_rollout(runtime_dir: Path, expected: int, timeout: float = 600.0) -> None:
    """Block until `expected` rollout steps have completed and nothing is pending."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rollout = control_request(runtime_dir, {"cmd": "status"})["rollout"]
        if rollout["completed"] >= expected and rollout["pending"] == 0:
            return
        if rollout["last_error"]:
            raise SystemExit(f"rollout failed: {rollout['last_error']}")
        time.sleep(0.1)
    raise SystemExit("rollout did not finish")


def row(label: str, samples: list[tuple[float, float, str]]) -> str:
    """One line of the table."""
    latencies = [s[1] for s in samples if s[2] == "OK"]
    failed = sum(1 for s in samples if s[2] != "OK")
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    return f"  {label:<28} n={len(samples):>5} failed={failed:>3} p50={p50} ms p99={p99} ms"


def main() -> int:
    """Run both rollouts under load and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", choices=sorted(SHAPES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds of steady load before and after")
    args = parser.parse_args()
    config: dict[str, Any] = {
        "log_level": "warning",
        "models": {
            args.model: builtin_entry(
                args.model, workers=args.workers, queue_size=4 * args.clients, warmup_iterations=2
            )
        },
    }
    runtime_dir = Path(tempfile.mkdtemp(prefix="infervisor-rolling-")) / "run"
    daemon = start_daemon(config, runtime_dir)
    config_path = runtime_dir.parent / f"{runtime_dir.name}-config.json"
    recorder = Recorder(f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}", args.model, args.clients)
    fewest = [args.workers]
    done = threading.Event()
    watcher = threading.Thread(target=fewest_serving, args=(runtime_dir, args.model, done, fewest), daemon=True)
    marks: dict[str, float] = {}
    try:
        for thread in recorder.threads:
            thread.start()
        time.sleep(2.0)  # warm the clients' connections before measuring
        marks["before"] = time.monotonic()
        time.sleep(args.settle)
        watcher.start()
        marks["restart"] = time.monotonic()
        control_request(runtime_dir, {"cmd": "restart"})
        wait_rollout(runtime_dir, args.workers)
        marks["restart_done"] = time.monotonic()
        time.sleep(args.settle)
        marks["reload"] = time.monotonic()
        config["models"][args.model]["warmup_iterations"] = 3
        temp = config_path.with_suffix(".tmp")
        temp.write_text(json.dumps(config))
        os.replace(temp, config_path)  # write-temp-then-rename, as deploy tools do
        wait_rollout(runtime_dir, 2 * args.workers)
        marks["reload_done"] = time.monotonic()
        time.sleep(args.settle)
        marks["end"] = time.monotonic()
    finally:
        recorder.stop.set()
        done.set()
        for thread in recorder.threads:
            thread.join(120)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    before = recorder.window(marks["before"], marks["restart"])
    restart = recorder.window(marks["restart"], marks["restart_done"])
    between = recorder.window(marks["restart_done"], marks["reload"])
    reload = recorder.window(marks["reload"], marks["reload_done"])
    after = recorder.window(marks["reload_done"], marks["end"])
    everything = recorder.window(0.0, float("inf"))
    print(f"model {args.model}, {args.workers} workers, {args.clients} clients")
    print(row("before", before))
    print(row(f"restart ({marks['restart_done'] - marks['restart']:.1f} s)", restart))
    print(row("between", between))
    print(row(f"config reload ({marks['reload_done'] - marks['reload']:.1f} s)", reload))
    print(row("after", after))
    failed = sum(1 for s in everything if s[2] != "OK")
    p99_before = percentile([s[1] for s in before if s[2] == "OK"], 99) or 0.0
    p99_during = percentile([s[1] for s in restart + reload if s[2] == "OK"], 99) or 0.0
    ratio = p99_during / p99_before if p99_before else float("inf")
    print(f"failed requests (whole run): {failed}; fewest serving workers: {fewest[0]} of {args.workers}")
    print(f"p99 during rollouts / before: {ratio:.2f}x")
    return 0 if failed == 0 and fewest[0] >= args.workers - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
