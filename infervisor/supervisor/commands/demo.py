"""`infervisor demo`: the main job end to end — start the daemon, send real requests, report, stop."""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from infervisor.common.profiles import PROFILES
from infervisor.protocol.client import Client
from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.protocol.control_client import ControlError, control_request
from infervisor.protocol.errors import InferenceError
from infervisor.supervisor.commands.build import run_build
from infervisor.supervisor.commands.infer import output_text, summarize, timing_text
from infervisor.supervisor.commands.status import describe_start, format_status
from infervisor.supervisor.observe.stats import percentile
from infervisor.supervisor.settings.config import ConfigError, load_config
from infervisor.supervisor.settings.config_path import ConfigPathError, resolve_config_path
from infervisor.supervisor.toolkit.inputs import random_inputs
from infervisor.supervisor.toolkit.provenance import infervisor_command
from infervisor.supervisor.toolkit.scratch import log_reason

#: Worker states the demo waits out: anything else is still on its way to serving (or to giving up).
_SETTLED = ("serving", "failed")
#: A starting worker in the same phase this long gets its progress line again, so the demo never goes quiet.
_REPEAT_PROGRESS_S = 15.0
#: Requests sent to a model in shadow per turn of the wait for the switch (a turn is about half a second).
_SHADOW_FEED = 5


class DemoError(Exception):
    """The demo cannot go on; the message says why (the daemon's own reason when it has one)."""


def _settled(status: dict[str, Any]) -> bool:
    """Every worker of every model serves, or was given up on: a load now meets the whole pool."""
    workers = [w for model in status["models"].values() for w in model["workers"]]
    return status["state"] != "stopping" and bool(workers) and all(w["state"] in _SETTLED for w in workers)


def _waiting_for(status: dict[str, Any]) -> str:
    waiting = [
        f"{name} slot {w['slot']} {w['state']}"
        for name, model in status["models"].items()
        for w in model["workers"]
        if w["state"] not in _SETTLED
    ]
    return ", ".join(waiting) or "the daemon to be ready"


class _StartProgress:
    """Prints a line for each starting worker whenever its phase changes (and again during a long one)."""

    def __init__(self) -> None:
        #: (model, slot) -> (pid, phase, profile) last printed and when.
        self.shown: dict[tuple[str, int], tuple[tuple[Any, ...], float]] = {}

    def show(self, status: dict[str, Any]) -> None:
        now = time.monotonic()
        for name, model in status["models"].items():
            for worker in model["workers"]:
                starting = worker.get("starting")
                if not starting:
                    continue
                where = (name, worker["slot"])
                key = (worker["pid"], starting["phase"], starting.get("profile"))
                last = self.shown.get(where)
                if last is None or last[0] != key or now - last[1] >= _REPEAT_PROGRESS_S:
                    self.shown[where] = (key, now)
                    line = f"  {name} slot {worker['slot']} (pid {worker['pid']}): {describe_start(starting)}"
                    print(line, flush=True)


def _wait_serving(
    process: subprocess.Popen[bytes], runtime_dir: Path, log_path: Path, timeout: float
) -> dict[str, Any]:
    """The status document once every worker serves (or failed for good); DemoError with the reason otherwise.

    Meanwhile each starting worker's phase (loading, building profile i of n, checking, warming up) is printed.
    """
    deadline = time.monotonic() + timeout
    status: dict[str, Any] | None = None
    progress = _StartProgress()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            reason = log_reason(log_path.read_text(errors="replace"))
            raise DemoError(f"the daemon exited with code {process.returncode} before it served: {reason}")
        try:
            status = control_request(runtime_dir, {"cmd": "status"}, timeout=2.0)
        except ControlError:
            status = None  # not listening yet
        if status is not None and _settled(status):
            return status
        if status is not None:
            progress.show(status)
        time.sleep(0.1)
    waiting = _waiting_for(status) if status is not None else "its control socket"
    raise DemoError(f"not every worker served within {timeout:.0f} s (waiting for {waiting}); raise --start-timeout")


def _switched(status: dict[str, Any]) -> bool:
    """Every model's background build ended, and where it picked a profile every worker serves it."""
    for model in status["models"].values():
        build = model.get("build") or {}
        if build.get("state") in ("waiting", "building", "shadow"):
            return False
        members = [w for w in model["workers"] if "role" not in w]
        if build.get("state") == "done" and not all(
            w["state"] == "serving" and w.get("profile") == build.get("picked") for w in members
        ):
            return False
    return True


def _wait_switch(process: subprocess.Popen[bytes], runtime_dir: Path, timeout: float) -> dict[str, Any] | None:
    """Print each model's background build as it goes; the status once the workers serve its pick (None: gave up)."""
    deadline = time.monotonic() + timeout
    shown: dict[str, tuple[str, float]] = {}
    while time.monotonic() < deadline and process.poll() is None:
        try:
            status = control_request(runtime_dir, {"cmd": "status"}, timeout=2.0)
        except ControlError:
            return None
        if _switched(status):
            return status
        _feed_shadows(runtime_dir, status)
        now = time.monotonic()
        for name, model in status["models"].items():
            summary = str((model.get("build") or {}).get("summary") or "")
            # The summary's elapsed seconds change every second: a new line only on a new phase or every 15 s.
            key = summary.split(",")[0]
            last = shown.get(name)
            if summary and (last is None or last[0] != key or now - last[1] >= _REPEAT_PROGRESS_S):
                shown[name] = (key, now)
                print(
                    f"  {name}: serves {', '.join(model.get('serving') or []) or 'nothing yet'}; {summary}", flush=True
                )
        time.sleep(0.5)
    return None


def _feed_shadows(runtime_dir: Path, status: dict[str, Any]) -> None:
    """A few requests to each model whose lossy pick is in shadow: it switches only on live traffic."""
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    for name, model in status["models"].items():
        if (model.get("build") or {}).get("state") != "shadow":
            continue
        with Client(endpoint) as client:
            for _ in range(_SHADOW_FEED):
                client.infer(name, random_inputs(model["inputs"], 1), timeout=60)


def _served(status: dict[str, Any]) -> dict[str, list[str]]:
    """model -> the profiles its workers serve (status `serving`)."""
    return {name: sorted(model.get("serving") or []) for name, model in status["models"].items()}


def switch_line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> tuple[str, bool]:
    """What the background build came to, and whether any model's workers moved to another profile."""
    was, now = _served(before), _served(after)
    moved = [f"{name} {', '.join(was.get(name) or ['nothing'])} -> {', '.join(profiles) or 'nothing'}"
             for name, profiles in now.items() if profiles != was.get(name)]  # fmt: skip
    if moved:
        return f"switched to the builder's pick after {seconds:.1f} s: {'; '.join(moved)}", True
    kept = "; ".join(f"{name} {', '.join(profiles) or 'nothing'}" for name, profiles in now.items())
    return f"the builder's pick is what already served ({kept}), checked after {seconds:.1f} s: nothing switched", False


def _load(
    endpoint: str,
    model: str,
    inputs: dict[str, Any],
    count: int,
    results: tuple[list[float], list[str]],
    stop: threading.Event,
) -> None:
    latencies, errors = results
    with Client(endpoint) as client:
        for _ in range(count):
            if stop.is_set():
                return
            started = time.perf_counter()
            try:
                client.infer(model, inputs, timeout=60)
            except InferenceError as exc:
                errors.append(str(exc.code))
                continue
            latencies.append((time.perf_counter() - started) * 1000.0)


def load_line(name: str, latencies: list[float], errors: list[str], clients: int, elapsed: float) -> str:
    """The figures a reader looks for first (req/s, p50, p99), then how they were made."""
    return (
        f"{name}: {len(latencies) / elapsed:.1f} req/s, p50 {percentile(latencies, 50)} ms, p99 "
        f"{percentile(latencies, 99)} ms  ({len(latencies)} ok, {len(errors)} errors, {clients} clients, "
        f"{elapsed:.2f} s)"
    )


def _exercise(runtime_dir: Path, status: dict[str, Any], args: argparse.Namespace, stop: threading.Event) -> int:
    """One request and a concurrent load per serving model; 0 when every model served without an error."""
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    outcome = 0
    for name, model in status["models"].items():
        if not any(w["state"] == "serving" for w in model["workers"]):
            print(f"{name}: no worker serves (see the table above), skipped\n")
            outcome = 1
            continue
        inputs = random_inputs(model["inputs"], 1)
        with Client(endpoint) as client:
            first = time.perf_counter()
            outputs, timing = client.infer_with_timing(name, inputs, timeout=60)
            print(
                f"{name}: one request in {(time.perf_counter() - first) * 1000:.2f} ms (server: {timing_text(timing)})"
            )
        for out_name, array in outputs.items():
            print(f"  {output_text(summarize(out_name, array))}")
        results: tuple[list[float], list[str]] = ([], [])
        per_client = max(1, args.requests // args.clients)
        # Daemon threads with a stop flag: a Ctrl-C in the main thread must not wait for the load to finish.
        threads = [
            threading.Thread(target=_load, args=(endpoint, name, inputs, per_client, results, stop), daemon=True)
            for _ in range(args.clients)
        ]
        load_started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - load_started
        latencies, errors = results
        if errors:
            outcome = 1
        print(load_line(name, latencies, errors, args.clients, elapsed) + "\n")
    # The table again for the figures the load left (requests, p50/p99 per worker); its notes were shown above.
    print(format_status(control_request(runtime_dir, {"cmd": "status"}), notes=False))
    return outcome


def _stop(process: subprocess.Popen[bytes], grace: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wants_build(config_path: Path) -> bool:
    """True when the config's cache has something to hold: a packaged profile in a chain, or a fastest pick."""
    try:
        config = load_config(config_path)
    except ConfigError:
        return False  # the daemon itself says what is wrong with it
    return any(m.pick == "fastest" or any(PROFILES[p].packaged for p in m.profiles) for m in config.models.values())


def run_demo(args: argparse.Namespace) -> int:
    """Start `infervisor serve`, exercise every model, print results and latency, then stop it and clean up."""
    try:
        choice = resolve_config_path(args.config)
    except ConfigPathError as exc:
        print(f"infervisor demo: {exc}", file=sys.stderr)
        return 2
    made_dir = args.runtime_dir is None
    runtime_dir = (
        Path(args.runtime_dir).resolve() if args.runtime_dir else Path(tempfile.mkdtemp(prefix="infervisor-demo-"))
    )
    log_path = runtime_dir.parent / f"{runtime_dir.name}.log"
    print(f"config: {choice.describe()}")
    stop = threading.Event()
    process: subprocess.Popen[bytes] | None = None
    outcome = 1
    # A SIGTERM (`timeout`, a closed session) cleans up as a Ctrl-C does instead of leaving the daemon running.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.build and _wants_build(choice.path):
            # The cache filled first: the compile shows its progress here, and the daemon then starts in seconds.
            print(f"building the compiled packages first: infervisor build --config {choice.path}")
            built_at = time.monotonic()
            built = run_build(argparse.Namespace(config=str(choice.path), models=None, json=None, config_named=True))
            print(f"build {'done' if built == 0 else f'ended with {built} (the daemon skips what failed)'} in "
                  f"{time.monotonic() - built_at:.1f} s\n")  # fmt: skip
        print(f"starting: infervisor serve --config {choice.path} --runtime-dir {runtime_dir}  (log: {log_path})")
        started = time.monotonic()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "infervisor", "serve", "--config", str(choice.path),
                 "--runtime-dir", str(runtime_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        status = _wait_serving(process, runtime_dir, log_path, args.start_timeout)
        print(f"every worker serves after {time.monotonic() - started:.2f} s\n")
        print(format_status(status, notes=args.notes) + "\n")
        if not args.notes:
            status_command = shlex.join([*infervisor_command(), "status", "--runtime-dir", str(runtime_dir)])
            print(f"why each worker serves its profile: {status_command} while the demo runs (or demo --notes)\n")
        outcome = _exercise(runtime_dir, status, args, stop)
        if args.switch_timeout > 0 and not _switched(status):
            print("\nthe background builder optimizes behind the answers; waiting for its pick (Ctrl-C ends it)")
            switched = _wait_switch(process, runtime_dir, args.switch_timeout)
            if switched is not None:
                line, moved = switch_line(status, switched, time.monotonic() - started)
                print(line + "\n")
                if moved:
                    outcome = _exercise(runtime_dir, switched, args, stop) or outcome
    except DemoError as exc:
        print(f"infervisor demo: {exc}", file=sys.stderr)
    except (ControlError, InferenceError) as exc:
        print(f"infervisor demo: the daemon stopped answering: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("infervisor demo: interrupted, stopping the daemon", file=sys.stderr)
        outcome = 130
    finally:
        stop.set()
        # A second Ctrl-C must not cut the stop short and leave a daemon or its directory behind.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            code = _stop(process) if process is not None else None
            if made_dir:
                shutil.rmtree(runtime_dir, ignore_errors=True)  # the daemon removed its sockets; this is the rest
        finally:
            signal.signal(signal.SIGINT, previous)
    if code is not None:
        print(f"\ndaemon exited with code {code}; its log: {log_path}")
    # The log stays (it is the one place that says what the daemon did); the directory of sockets goes.
    return outcome if outcome or code == 0 else 1
