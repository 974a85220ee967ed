"""The Stability Hardening Protocol (seed 2, section 5), compressible in time, against a live daemon.

Five checks, each pass/fail with its numbers: polluted input, memory pressure, chaos (kill -9 and
SIGSTOP of workers under load), soak (P99, RSS and answer drift sampled at intervals) and thermal /
frequency drift where it can be read. Torch-free: it drives the daemon through its sockets.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from infervisor.protocol.client import Client
from infervisor.protocol.client_messages import InferRequest, decode_reply, encode_infer
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.control_client import control_request
from infervisor.protocol.errors import InferenceError, ProtocolError
from infervisor.protocol.tensors import TensorDesc
from infervisor.supervisor.toolkit.probe import quantile

#: A memory hog run by `python -c`: allocates and touches MB in 64 MB steps, holds them, exits on its timeout.
_HOG = (
    "import sys, time\n"
    "mb, hold = int(sys.argv[1]), float(sys.argv[2])\n"
    "chunks = [bytearray(64 * 2**20) for _ in range(max(1, mb // 64))]\n"
    "for c in chunks:\n"
    "    c[::4096] = b'x' * len(c[::4096])\n"
    "time.sleep(hold)\n"
)


@dataclass
class CheckResult:
    """One check of the protocol; a check this box cannot make is not measured, neither passed nor failed."""

    name: str
    passed: bool
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)
    measured: bool = True


@dataclass
class Target:
    """The daemon and model under test."""

    runtime_dir: Path
    endpoint: str
    model: str
    inputs: dict[str, np.ndarray[Any, Any]]

    def status(self) -> dict[str, Any]:
        """The daemon's status document."""
        return control_request(self.runtime_dir, {"cmd": "status"})

    def workers(self) -> list[dict[str, Any]]:
        """The model's pool (successors and retiring workers left out)."""
        return [w for w in self.status()["models"][self.model]["workers"] if "role" not in w]


class Load:
    """Client threads sending numbered requests back to back; a number without an answer is a lost request."""

    def __init__(self, target: Target, clients: int = 2) -> None:
        self.target = target
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent: set[int] = set()
        self.answered: set[int] = set()
        self.errors: dict[str, int] = {}
        self.latencies: list[float] = []
        self.numbers = itertools.count()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        with Client(self.target.endpoint) as client:
            while not self.stop.is_set():
                with self.lock:
                    number = next(self.numbers)
                    self.sent.add(number)
                started = time.perf_counter()
                try:
                    client.infer(self.target.model, self.target.inputs, timeout=60)
                except InferenceError as exc:
                    code = str(exc.code.value if isinstance(exc.code, ErrorCode) else exc.code)
                    with self.lock:
                        self.errors[code] = self.errors.get(code, 0) + 1
                        self.answered.add(number)
                    continue
                with self.lock:
                    self.answered.add(number)
                    self.latencies.append((time.perf_counter() - started) * 1000.0)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)

    def lost(self) -> int:
        """Requests sent and never answered (a client timeout counts as an answer: TIMEOUT)."""
        return len(self.sent - self.answered)


def _raw(target: Target, header: bytes, frames: list[bytes]) -> tuple[str | None, str]:
    """One hand-made request on a bare DEALER: the error code of the reply (None for a result) and its message."""
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(target.endpoint)
    try:
        socket.send_multipart([b"", header, *frames])
        if not socket.poll(30_000):
            return "NO_REPLY", "no reply within 30 s"
        reply = socket.recv_multipart()
        decoded = decode_reply(reply[1], [len(f) for f in reply[2:]])
    except ProtocolError as exc:
        return "UNDECODABLE", exc.message
    finally:
        socket.close()
    if isinstance(decoded, ProtocolError):
        return decoded.code.value, decoded.message
    return None, ""


def check_polluted_input(target: Target) -> CheckResult:
    """inf/NaN, wrong shape, wrong dtype, oversized and truncated frames, garbage: each a clear error, serving on."""
    name, array = next(iter(target.inputs.items()))
    others = [a for n, a in target.inputs.items() if n != name]
    other_descs = [TensorDesc(n, a.dtype.name, tuple(a.shape)) for n, a in target.inputs.items() if n != name]

    def request(desc: TensorDesc, frame: bytes) -> tuple[bytes, list[bytes]]:
        header = encode_infer(InferRequest(1, target.model, (desc, *other_descs)))
        return header, [frame, *(a.tobytes() for a in others)]

    desc = TensorDesc(name, array.dtype.name, tuple(array.shape))
    cases: dict[str, tuple[bytes, list[bytes]]] = {
        "truncated frame": request(desc, array.tobytes()[:-4]),
        "oversized frame": request(desc, array.tobytes() + b"\0" * 64),
        "wrong shape": request(TensorDesc(name, array.dtype.name, (*array.shape, 1)), array.tobytes()),
        "wrong dtype": request(TensorDesc(name, "float64", tuple(array.shape)), np.zeros(array.shape).tobytes()),
        "garbage header": (b"\xc1\xff not msgpack", []),
    }
    if array.dtype.kind == "f":
        for label, value in (("NaN", np.nan), ("inf", np.inf)):
            polluted = array.copy()
            polluted.flat[0] = value
            cases[label] = request(desc, polluted.tobytes())
    outcomes: dict[str, str] = {}
    failures = []
    for label, (header, frames) in cases.items():
        code, message = _raw(target, header, frames)
        outcomes[label] = f"{code}: {message[:80]}" if code else "served (no error)"
        clear = code in ("INVALID_INPUT", "BAD_REQUEST") and bool(message)
        healthy, _ = _raw(target, *request(desc, array.tobytes()))
        if not clear or healthy is not None:
            failures.append(label)
    detail = "every polluted request got a clear error and the next valid one was served"
    if failures:
        detail = f"not handled cleanly: {', '.join(failures)}"
    return CheckResult("polluted input", not failures, detail, {"outcomes": outcomes})


def _rss_mb(target: Target) -> dict[int, float]:
    return {w["pid"]: (w["rss"] or 0) / 2**20 for w in target.workers() if w["pid"]}


def check_memory_pressure(target: Target, seconds: float, hog_mb: int, max_growth: float = 0.10) -> CheckResult:
    """A memory hog (stress-ng when installed) runs beside the load; each worker's RSS may grow at most 10%."""
    before = _rss_mb(target)
    if shutil.which("stress-ng"):
        command = ["stress-ng", "--vm", "1", "--vm-bytes", f"{hog_mb}M", "--timeout", f"{max(1, int(seconds))}s"]
    else:
        command = [sys.executable, "-c", _HOG, str(hog_mb), str(seconds)]
    with Load(target) as load:
        hog = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            hog.wait(seconds + 30)
        except subprocess.TimeoutExpired:
            hog.kill()
            hog.wait()
    after = _rss_mb(target)
    growth = {pid: (after[pid] - mb) / mb for pid, mb in before.items() if pid in after and mb > 0}
    worst = max(growth.values(), default=0.0)
    numbers = {"hog_mb": hog_mb, "rss_before_mb": before, "rss_after_mb": after, "errors": load.errors,
               "lost": load.lost(), "requests": len(load.answered)}  # fmt: skip
    passed = worst <= max_growth and load.lost() == 0 and not load.errors
    detail = f"{hog_mb} MB hog for {seconds:g} s: worst worker RSS growth {worst:+.1%}, {len(load.answered)} requests"
    detail += f", {load.lost()} lost, errors {load.errors or 'none'}"
    return CheckResult("memory pressure", passed, detail, numbers)


def check_chaos(target: Target, seconds: float, freeze_s: float = 1.0) -> CheckResult:
    """Under load: kill -9 a worker, then SIGSTOP one for `freeze_s` and SIGCONT it; every request answered once."""
    events: list[str] = []
    with Load(target) as load:
        time.sleep(seconds / 3)
        victim = next((w for w in target.workers() if w["state"] == "serving"), None)
        if victim is not None:
            os.kill(victim["pid"], signal.SIGKILL)
            events.append(f"kill -9 {victim['pid']}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(w["state"] == "serving" for w in target.workers()):
            time.sleep(0.1)
        time.sleep(seconds / 3)
        frozen = next((w for w in target.workers() if w["state"] == "serving"), None)
        if frozen is not None:
            os.kill(frozen["pid"], signal.SIGSTOP)
            time.sleep(freeze_s)
            os.kill(frozen["pid"], signal.SIGCONT)
            events.append(f"SIGSTOP {frozen['pid']} for {freeze_s:g} s")
        time.sleep(seconds / 3)
    lost = load.lost()
    passed = lost == 0 and not load.errors
    detail = f"{', '.join(events) or 'no serving worker to disturb'}; sent {len(load.sent)}, lost {lost}, "
    detail += f"errors {load.errors or 'none'}"
    numbers = {"events": events, "lost": lost, "errors": load.errors}
    return CheckResult("chaos", passed and bool(events), detail, numbers)


def check_soak(target: Target, seconds: float, interval: float, p99_limit_ms: float | None) -> CheckResult:
    """Load for `seconds`: P99 per interval, RSS per worker, and a fixed input's answer against its first one."""
    drift = 0.0
    series: list[dict[str, Any]] = []
    with Client(target.endpoint) as probe, Load(target) as load:
        reference = probe.infer(target.model, target.inputs, timeout=60)
        started = time.monotonic()
        seen = 0
        while time.monotonic() - started < seconds:
            time.sleep(interval)
            with load.lock:
                window = load.latencies[seen:]
                seen = len(load.latencies)
            answer = probe.infer(target.model, target.inputs, timeout=60)
            drift = max(drift, *(float(np.max(np.abs(answer[k] - reference[k]), initial=0.0)) for k in reference))
            series.append({
                "t_s": round(time.monotonic() - started, 2),
                "p99_ms": round(quantile(window, 99), 3) if window else None,
                "rss_mb": {str(pid): round(mb, 1) for pid, mb in _rss_mb(target).items()},
                "max_abs_drift": drift,
            })  # fmt: skip
    p99s = [s["p99_ms"] for s in series if s["p99_ms"] is not None]
    worst = max(p99s, default=0.0)
    passed = load.lost() == 0 and not load.errors and drift == 0.0 and (p99_limit_ms is None or worst <= p99_limit_ms)
    limit = f" (limit {p99_limit_ms:g})" if p99_limit_ms is not None else ""
    detail = f"{len(series)} samples over {seconds:g} s: worst interval P99 {worst:.2f} ms{limit}, "
    detail += f"answer drift {drift:.3g}, lost {load.lost()}, errors {load.errors or 'none'}"
    return CheckResult("soak", passed, detail, {"seconds": seconds, "clients": len(load.threads), "series": series})


def check_thermal(target: Target, before: dict[str, Any]) -> CheckResult:
    """Temperature, throttle counters and frequency before and after, where the daemon can read them."""
    after = target.status().get("thermal", {})
    readable = {k: v for k, v in after.items() if v not in (None, [], {})}
    if not readable or all(after.get(k) is None for k in ("max_temp_c", "freq_mhz")):
        return CheckResult("thermal/frequency", False, "not measured: no thermal zones or cpufreq readable on this box",
                           {"before": before, "after": after}, measured=False)  # fmt: skip
    throttled = (after.get("throttle_events") or 0) - (before.get("throttle_events") or 0)
    detail = f"max temp {before.get('max_temp_c')} -> {after.get('max_temp_c')} C, {throttled} new throttle events"
    return CheckResult("thermal/frequency", throttled == 0, detail, {"before": before, "after": after})


def run_protocol(
    target: Target,
    seconds: float,
    hog_mb: int,
    p99_limit_ms: float | None,
    chaos: bool,
    progress: Callable[[str], None] = lambda _: None,
) -> list[CheckResult]:
    """All five checks; `seconds` is split between the timed ones."""
    thermal_before = dict(target.status().get("thermal", {}))
    share = max(2.0, seconds / 3)
    results = [check_polluted_input(target)]
    progress(results[-1].detail)
    results.append(check_memory_pressure(target, share, hog_mb))
    progress(results[-1].detail)
    if chaos:
        results.append(check_chaos(target, share))
        progress(results[-1].detail)
    results.append(check_soak(target, share, max(0.5, share / 5), p99_limit_ms))
    progress(results[-1].detail)
    results.append(check_thermal(target, thermal_before))
    return results
