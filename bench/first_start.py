"""First start with an empty cache: time to the first correct answer and to READY=1, time until the background
builder's pick serves, and what the build costs serving (P99 during the build over P99 without one, same run).

    python bench/first_start.py [--config configs/default.json] [--rate 4] [--baseline-s 40]
    python bench/first_start.py --first-answer-only [--runs 3]

Phase 1, the baseline: the config's models with an eager-only chain (nothing to build), under the load below
for --baseline-s. Phase 2: the config as it is, with an empty cache: the first correct answer (cosine >= 0.98
with eager run in this process, and the same top-1) and READY=1 (from a fake NOTIFY_SOCKET, as systemd reads
it) are timed from `infervisor serve`; the same load runs from the first answer until every worker serves the
builder's pick. The load is 2 clients, each sending one request every 1/--rate s (a closed loop would leave an
idle-priority builder no CPU at all). Requests that fail are counted; a run with any is reported as such.
A lossy pick (int8, bf16) runs in shadow on that load before the switch: when it began, what it came to and
serving's P99 meanwhile are reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infervisor.protocol import Client, InferenceError  # noqa: E402
from infervisor.protocol.control_client import ControlError, control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

_MAX_REQUESTS = 1_000_000


class PacedLoad:
    """Clients each sending one request every `period` s (or as soon as the previous answer came, if later)."""

    def __init__(self, endpoint: str, model: str, inputs: dict[str, np.ndarray], clients: int, period: float) -> None:
        self.endpoint, self.model, self.inputs, self.period = endpoint, model, inputs, period
        self.samples: list[tuple[float, float]] = []  # (sent at, latency ms)
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        with Client(self.endpoint) as client:
            due = time.monotonic()
            while not self.stop.is_set() and len(self.samples) < _MAX_REQUESTS:
                started = time.monotonic()
                try:
                    client.infer(self.model, self.inputs, timeout=120)
                    self.samples.append((started, (time.monotonic() - started) * 1000.0))
                except InferenceError as exc:
                    self.failures.append(f"{exc.code}: {exc.message}")
                due = max(due + self.period, time.monotonic())
                self.stop.wait(max(0.0, due - time.monotonic()))

    def start(self) -> PacedLoad:
        for thread in self.threads:
            thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)

    def p99(self, since: float = 0.0, until: float = float("inf")) -> tuple[float, int]:
        chosen = [ms for at, ms in self.samples if since <= at < until]
        p99 = percentile(chosen, 99)
        return (float("nan") if p99 is None else p99), len(chosen)  # nan: no request fell in the window


def _eager_reference(config: dict[str, Any], name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    from infervisor.protocol.launch import ModelSource
    from infervisor.worker.loader import load_model

    source = config["models"][name]["source"]
    module = load_model(ModelSource("builtin", source["builtin"]))
    with torch.inference_mode():
        return np.asarray(module(*[torch.from_numpy(a) for a in inputs.values()]).numpy())


def _correct(got: np.ndarray, want: np.ndarray) -> bool:
    cosine = float(np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want)))
    return cosine >= 0.98 and int(got.argmax()) == int(want.argmax())


def _status(runtime: Path) -> dict[str, Any] | None:
    try:
        return control_request(runtime, {"cmd": "status"}, timeout=10.0)
    except ControlError:
        return None


def _start(config: dict[str, Any], folder: Path) -> tuple[subprocess.Popen[bytes], socket.socket, Path, float]:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(folder / "notify.sock"))
    notify.setblocking(False)
    runtime = folder / "run"
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "infervisor", "serve", "--config", str(folder / "config.json"), "--runtime-dir",
         str(runtime)],
        cwd=ROOT, stdout=(folder / "daemon.log").open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "NOTIFY_SOCKET": str(folder / "notify.sock")},
    )  # fmt: skip
    return process, notify, runtime, started


def _first_answer(
    runtime: Path, notify: socket.socket, ready: list[float], deadline: float, name: str,
    inputs: dict[str, np.ndarray], want: np.ndarray,
) -> float | None:  # fmt: skip
    """When the daemon first answered correctly (noting READY=1 meanwhile), or None by the deadline."""
    with Client(f"ipc://{runtime}/infer.sock") as client:
        while time.monotonic() < deadline:
            _ready_at(notify, ready)
            try:
                got = next(iter(client.infer(name, inputs, timeout=2).values()))
            except InferenceError:
                time.sleep(0.05)
                continue
            if _correct(got, want):
                return time.monotonic()
    return None


def _ready_at(notify: socket.socket, seen: list[float]) -> None:
    try:
        while True:
            if b"READY=1" in notify.recv(4096) and not seen:
                seen.append(time.monotonic())
    except BlockingIOError:
        return


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def baseline(config: dict[str, Any], name: str, inputs: dict[str, np.ndarray], args: argparse.Namespace,
             folder: Path) -> tuple[float, int, int]:  # fmt: skip
    """P99 and count of the paced load on an eager-only chain (nothing built), and its failures."""
    plain = json.loads(json.dumps(config))
    plain["models"][name].update(profiles=["eager"], pick="first")
    process, _, runtime, _ = _start(plain, folder)
    try:
        while not ((s := _status(runtime)) and all(w["state"] == "serving" for w in s["models"][name]["workers"])):
            time.sleep(0.2)
        load = PacedLoad(f"ipc://{runtime}/infer.sock", name, inputs, 2, 1.0 / args.rate).start()
        time.sleep(args.baseline_s)
        load.finish()
        p99, count = load.p99()
        return p99, count, len(load.failures)
    finally:
        _stop(process)


def _shadow_rows(shadow: dict[str, Any] | None, shadow_at: float | None, done: float, started: float,
                 base_p99: float, load: PacedLoad) -> list[tuple[str, str]]:  # fmt: skip
    """The lossy pick's shadow: when it began, what it came to, and serving's P99 meanwhile."""
    if shadow is None or shadow_at is None:
        return [("shadow", "none (the pick is exact, or `shadow: off`)")]
    p99, count = load.p99(shadow_at, done)
    return [
        (f"shadow of {shadow['profile']} began", f"{shadow_at - started:.1f} s ({done - shadow_at:.1f} s in shadow)"),
        ("shadow outcome", f"{shadow['state']}: {shadow['summary']}"),
        ("P99 during the shadow", f"{p99:.1f} ms ({count} requests), {p99 / base_p99:.2f}x the baseline"),
    ]


def first_answers(args: argparse.Namespace) -> int:
    """The first correct answer and READY=1 of --runs starts, each with an empty cache (nothing else measured)."""
    config = json.loads(Path(args.config).read_text())
    name = next(iter(config["models"]))
    spec = config["models"][name]["inputs"][0]
    inputs = {spec["name"]: np.random.default_rng(0).uniform(0, 1, [1, *spec["shape"][1:]]).astype(np.float32)}
    want = _eager_reference(config, name, inputs)
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="infervisor-first-answer-") as temp:
            config.update(cache_dir=str(Path(temp) / "empty-cache"))
            process, notify, runtime, started = _start(config, Path(temp) / "run")
            ready: list[float] = []
            answered = None
            try:
                answered = _first_answer(runtime, notify, ready, started + args.limit_s, name, inputs, want)
                while not ready and time.monotonic() - started < args.limit_s:
                    _ready_at(notify, ready)
                    time.sleep(0.05)
            finally:
                _stop(process)
            load = os.getloadavg()[0]
            first = f"{answered - started:.1f} s" if answered else "none"
            seen = f"{ready[0] - started:.1f} s" if ready else "not seen"
            print(f"run {run + 1}: first correct answer {first}, READY=1 {seen} (load average {load:.1f})", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.json"), help="the config to start")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second per client (2 clients)")
    parser.add_argument("--baseline-s", type=float, default=40.0, help="seconds of load on the eager-only chain")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="give up waiting for the switch after this")
    parser.add_argument("--first-answer-only", action="store_true", help="time the first answer and READY only")
    parser.add_argument("--runs", type=int, default=3, help="with --first-answer-only: starts, each on an empty cache")
    args = parser.parse_args()
    if args.first_answer_only:
        return first_answers(args)
    config = json.loads(Path(args.config).read_text())
    name = next(iter(config["models"]))
    spec = config["models"][name]["inputs"][0]
    shape = [1 if d is None else d for d in spec["shape"]]
    inputs = {spec["name"]: np.random.default_rng(0).uniform(0, 1, shape).astype(np.float32)}
    want = _eager_reference(config, name, inputs)
    with tempfile.TemporaryDirectory(prefix="infervisor-first-start-") as temp:
        base_p99, base_count, base_failed = baseline(config, name, inputs, args, Path(temp) / "baseline")
        config.update(cache_dir=str(Path(temp) / "empty-cache"), log_level="info")
        process, notify, runtime, started = _start(config, Path(temp) / "first")
        ready: list[float] = []
        first_answer = None
        load: PacedLoad | None = None
        try:
            first_answer = _first_answer(runtime, notify, ready, started + args.limit_s, name, inputs, want)
            load = PacedLoad(f"ipc://{runtime}/infer.sock", name, inputs, 2, 1.0 / args.rate).start()
            switched = build_done = shadow_at = None
            picked, shadow = "?", None
            while switched is None and time.monotonic() - started < args.limit_s:
                _ready_at(notify, ready)
                status = _status(runtime)
                model = status["models"][name] if status else {}
                build = model.get("build") or {}
                if build.get("state") == "shadow" and shadow_at is None:
                    shadow_at = time.monotonic()
                shadow = build.get("shadow") or shadow
                if build.get("state") == "done" and build_done is None:
                    build_done, picked = time.monotonic(), build.get("picked") or "?"
                members = [w for w in model.get("workers", []) if "role" not in w]
                if build_done and members and all(w["state"] == "serving" and w["profile"] == picked for w in members):
                    switched = time.monotonic()
                time.sleep(0.5)
            load.finish()
        finally:
            if load is not None:
                load.finish()
            _stop(process)
        if first_answer is None or switched is None or build_done is None or load is None:
            print("did not switch within the limit; see", Path(temp) / "first" / "daemon.log")
            return 1
        during_p99, during_count = load.p99(first_answer, shadow_at or build_done)
        rows = [
            ("first correct answer after `infervisor serve`", f"{first_answer - started:.1f} s"),
            ("READY=1 after `infervisor serve`", f"{ready[0] - started:.1f} s" if ready else "not seen"),
            (f"background build done (picked {picked})", f"{build_done - started:.1f} s"),
            (f"every worker serving {picked}", f"{switched - started:.1f} s ({switched - build_done:.1f} s after)"),
            ("P99 without a build (eager-only chain)", f"{base_p99:.1f} ms ({base_count} requests)"),
            ("P99 during the background build", f"{during_p99:.1f} ms ({during_count} requests)"),
            ("ratio", f"{during_p99 / base_p99:.2f}x"),
            *_shadow_rows(shadow, shadow_at, build_done, started, base_p99, load),
            ("failed requests (baseline, first start)", f"{base_failed}, {len(load.failures)}"),
        ]
        print(f"config {args.config}, load 2 clients x {args.rate:g} req/s, {os.cpu_count()} cpus")
        for label, value in rows:
            print(f"| {label} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
