"""Streams of a stateful model: batching across streams, a stream's per-step cost, and streams that outlive a worker.

    python bench/streams.py [--streams 64] [--seconds 5] [--rounds 3] [--procs 4] [--overhead-steps 300]
                            [--survive-streams 100] [--survive-steps 200] [--survive-pace-ms 30] [--quick]
                            [--json out.json]

One daemon serves the GRU step of bench/stream_models.py (64 features a chunk, hidden state 256, eager, one
thread a worker) as four models, which differ only in these keys:

  stream   `state` declared, batching on (max_batch_size 64): the daemon keeps each stream's state and batches
           the steps of different streams together
  carried  no `state`, batching off: each client sends its `h` and takes `h_out` back on every call, as before
           streams (docs/configuration.md, "Stateful models")
  single   `state` declared, batching off: one stream's per-step cost against a stateless call of it
  survive  `state` declared, batching off, 2 workers: the survival run

1. Batching across streams: `--streams` concurrent streams (one client connection each, in `--procs` client
   processes) step for `--seconds` on `stream`, then as many client-carried streams on `carried`, in alternating
   order over `--rounds` rounds; the ratio of steps/s is taken per round (target: at least 4x at 64 streams).
   P99 per step on `stream` at 1, 8 and `--streams` streams.
2. Per-step overhead: one stream on `single` against stateless calls of the same model and worker (the client
   sending `h` and keeping `h_out`), interleaved one for one over `--overhead-steps` x `--rounds` steps each
   (after as many of warm-up): the ratio of the medians (target: <= 10%).
3. Survival: `--survive-streams` streams of `--survive-steps` steps each on `survive`, one step every
   `--survive-pace-ms` (an audio chunk's pace); at an eighth of the steps one worker is killed (-9), at a quarter
   a rolling restart of the model begins (the table says at which step it was done). Every answer (the scores
   and the returned state) is compared with the reference run of the same stream step by step in one process
   (eager, one thread: exact), and every error counts (target: every answer equal, 0 errors).

`--quick` is a CI-safe run (about 5 minutes on a loaded 2-vCPU box): 1.5 s windows, one round, 20 streams x
60 steps to survive.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import start_daemon  # noqa: E402
from bench.stream_models import FEATURES, HIDDEN  # noqa: E402
from infervisor.protocol import Client, InferenceError  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

SOURCE = {"python": "bench.stream_models:gru"}
INPUTS = [
    {"name": "x", "dtype": "float32", "shape": [None, FEATURES]},
    {"name": "h", "dtype": "float32", "shape": [None, HIDDEN]},
]
STATE = [{"input": "h", "output": "h_out", "dtype": "float32", "shape": [HIDDEN]}]
#: Distinct chunks the throughput clients cycle through (drawn once: the clients measure the daemon, not numpy).
_CHUNKS = 64


def config(streams: int) -> dict[str, Any]:
    """The daemon's config: the four models of the module docstring."""
    common = {"source": SOURCE, "inputs": INPUTS, "outputs": ["y", "h_out"], "threads": 1, "warmup_iterations": 2,
              "queue_size": max(256, 4 * streams), "build": "at_start"}  # fmt: skip
    stateful = {**common, "state": STATE}
    return {
        "oversubscribe": True,
        "log_level": "warning",
        "models": {
            "stream": {**stateful, "batching": {"max_batch_size": 64, "max_queue_delay_us": 1000}},
            "carried": dict(common),
            "single": dict(stateful),
            "survive": {**stateful, "workers": 2},
        },
    }


def chunk(stream: int, step: int) -> np.ndarray:
    """The survival run's chunk of `stream` at `step` (the reference draws the same)."""
    return np.random.default_rng(stream * 100_003 + step).standard_normal((1, FEATURES)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# client processes


def _step_loop(endpoint: str, model: str, carried: bool, ready: Any, window: Any, out: list[Any]) -> None:
    """One stream: connected, counted in `ready`, stepping from when `window` is set (its warm-up first) until its
    end; keeps the latencies (ms) of the steps that began and finished inside the window."""
    chunks = [np.random.default_rng(i).standard_normal((1, FEATURES)).astype(np.float32) for i in range(_CHUNKS)]
    latencies: list[float] = []
    errors = 0
    with Client(endpoint) as client, client.stream(model) as stream:
        with ready.get_lock():
            ready.value += 1
        while window[1] == 0.0:
            time.sleep(0.005)
        start_at, stop_at = window[0], window[1]
        h = np.zeros((1, HIDDEN), np.float32)
        step = 0
        while (now := time.time()) < stop_at:
            x = chunks[step % _CHUNKS]
            step += 1
            try:
                if carried:  # the stream is never started, so leaving the block sends nothing
                    h = client.infer(model, {"x": x, "h": h})["h_out"]
                else:
                    stream.infer({"x": x})
            except InferenceError:
                errors += 1
                continue
            done = time.time()
            if now >= start_at and done <= stop_at:
                latencies.append((done - now) * 1000.0)
    out.append((latencies, errors))


def _throughput_process(endpoint: str, model: str, carried: bool, count: int, ready: Any, window: Any,
                        queue: Any) -> None:  # fmt: skip
    """`count` streams on threads of this process; puts (latencies of every counted step, errors)."""
    out: list[Any] = []
    threads = [
        threading.Thread(target=_step_loop, args=(endpoint, model, carried, ready, window, out)) for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    queue.put(([ms for latencies, _ in out for ms in latencies], sum(errors for _, errors in out)))


def _survive_stream(endpoint: str, model: str, index: int, steps: int, pace_s: float, progress: Any,
                    out: dict[int, Any]) -> None:  # fmt: skip
    """One stream of the survival run: its scores and returned states, step by step, and its errors."""
    scores: list[np.ndarray] = []
    states: list[np.ndarray] = []
    errors: list[str] = []
    with Client(endpoint) as client, client.stream(model, f"survive-{index}", return_state=True) as stream:
        for step in range(steps):
            began = time.monotonic()
            for _ in range(3):  # a step that failed changed no state: the next try is the same step
                try:
                    scores.append(stream.infer({"x": chunk(index, step)}, timeout=60.0)["y"])
                    states.append(stream.state["h_out"])
                    break
                except InferenceError as exc:
                    errors.append(f"step {step}: {exc.code}: {exc}")
            with progress.get_lock():
                progress.value += 1
            time.sleep(max(0.0, pace_s - (time.monotonic() - began)))
    out[index] = (scores, states, errors)


def _survive_process(endpoint: str, model: str, first: int, count: int, steps: int, pace_s: float, progress: Any,
                     queue: Any) -> None:  # fmt: skip
    """Streams first..first+count on threads, then each one's reference run here, step by step: puts, per stream,
    (steps answered, steps equal to the reference, largest difference, errors)."""
    out: dict[int, Any] = {}
    threads = [
        threading.Thread(target=_survive_stream, args=(endpoint, model, index, steps, pace_s, progress, out))
        for index in range(first, first + count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    import torch  # the reference: the same model, eager, one thread (as the worker runs it)

    from bench.stream_models import gru

    torch.set_num_threads(1)
    module = gru()
    results = []
    for index, (scores, states, errors) in sorted(out.items()):
        h = torch.zeros(1, HIDDEN)
        equal, largest = 0, 0.0
        with torch.inference_mode():
            for step, (score, state) in enumerate(zip(scores, states, strict=True)):
                y, h = module(torch.from_numpy(chunk(index, step)), h)
                same = np.array_equal(score, y.numpy()) and np.array_equal(state, h.numpy())
                equal += same
                largest = max(largest, float(np.abs(score - y.numpy()).max()), float(np.abs(state - h.numpy()).max()))
        results.append((len(scores), equal, largest, errors))
    queue.put(results)


def throughput(endpoint: str, model: str, carried: bool, streams: int, seconds: float, procs: int) -> dict[str, Any]:
    """Steps/s, P50 and P99 per step of `streams` concurrent streams over `seconds`, counted from a second after
    every stream is connected."""
    context = multiprocessing.get_context("spawn")
    queue, ready, window = context.Queue(), context.Value("i", 0), context.Array("d", [0.0, 0.0])
    counts = [streams // procs + (1 if i < streams % procs else 0) for i in range(min(procs, streams))]
    processes = [
        context.Process(target=_throughput_process, args=(endpoint, model, carried, n, ready, window, queue))
        for n in counts
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 300
    while ready.value < streams:
        if time.monotonic() > deadline or not all(p.is_alive() for p in processes):
            raise SystemExit(f"only {ready.value} of {streams} streams connected")
        time.sleep(0.01)
    start_at = time.time() + 1.0  # the warm-up: every stream stepping before the window opens
    window[0], window[1] = start_at, start_at + seconds
    results = [queue.get(timeout=300 + seconds) for _ in processes]
    for process in processes:
        process.join(60)
    latencies = [ms for found, _ in results for ms in found]
    return {
        "steps_per_s": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "errors": sum(errors for _, errors in results),
    }


def overhead(endpoint: str, steps: int, rounds: int) -> dict[str, Any]:
    """Median per-step latency of one stream on `single` against stateless calls of `single` (the client sending h),
    interleaved one for one in alternating order, so both take the same worker and see the same phases of a shared
    box; the first `steps` of each are warm-up."""
    chunks = [np.random.default_rng(i).standard_normal((1, FEATURES)).astype(np.float32) for i in range(_CHUNKS)]
    stream_ms: list[float] = []
    call_ms: list[float] = []
    h = np.zeros((1, HIDDEN), np.float32)

    def call(x: np.ndarray) -> None:
        nonlocal h
        h = client.infer("single", {"x": x, "h": h})["h_out"]

    with Client(endpoint) as client, client.stream("single") as stream:
        for step in range(steps * (rounds + 1)):
            x = chunks[step % _CHUNKS]
            for as_stream in (True, False) if step % 2 == 0 else (False, True):
                began = time.perf_counter()
                if as_stream:
                    stream.infer({"x": x})
                else:
                    call(x)
                if step >= steps:
                    (stream_ms if as_stream else call_ms).append((time.perf_counter() - began) * 1000.0)
    stream_median, call_median = statistics.median(stream_ms), statistics.median(call_ms)
    return {"stream_ms": stream_median, "call_ms": call_median, "overhead": stream_median / call_median - 1.0}


def _serving_pid(runtime_dir: Path, model: str) -> int | None:
    workers = control_request(runtime_dir, {"cmd": "status"})["models"][model]["workers"]
    return next((w["pid"] for w in workers if w["state"] == "serving" and w.get("pid")), None)


def survive(endpoint: str, runtime_dir: Path, streams: int, steps: int, pace_s: float, procs: int) -> dict[str, Any]:
    """The survival run: a worker killed at an eighth of the steps, a rolling restart begun at a quarter (early
    enough that the rollout, several seconds, ends inside the run)."""
    context = multiprocessing.get_context("spawn")
    progress = context.Value("q", 0)
    queue = context.Queue()
    counts = [streams // procs + (1 if i < streams % procs else 0) for i in range(min(procs, streams))]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    processes = [
        context.Process(target=_survive_process, args=(endpoint, "survive", f, n, steps, pace_s, progress, queue))
        for f, n in zip(firsts, counts, strict=True)
    ]
    for process in processes:
        process.start()
    total = streams * steps
    events: dict[str, int] = {}
    began = time.monotonic()
    # Until every step was tried (the processes then run their references and put their results, which must be
    # taken before they can exit).
    while (done := progress.value) < total and time.monotonic() - began < 900:
        if "killed" not in events and done >= total // 8:
            pid = _serving_pid(runtime_dir, "survive")
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                events["killed"] = done
        if "killed" in events and "restart" not in events and done >= total // 4:
            control_request(runtime_dir, {"cmd": "restart", "model": "survive"})
            events["restart"] = done
        if "restart" in events and "restarted" not in events:
            rollout = control_request(runtime_dir, {"cmd": "status"})["rollout"]
            if rollout["pending"] == 0 and rollout["completed"] >= 2:
                events["restarted"] = progress.value
        time.sleep(0.05)
    results = [row for _ in processes for row in queue.get(timeout=900)]
    for process in processes:
        process.join(60)
    errors = [e for *_, found in results for e in found]
    return {
        "streams": streams,
        "steps": steps,
        "answered": sum(r[0] for r in results),
        "equal": sum(r[1] for r in results),
        "largest_difference": max((r[2] for r in results), default=0.0),
        "errors": len(errors),
        "first_errors": errors[:5],
        "events": events,
    }


# ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    """Start the daemon, run the three measurements, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", type=int, default=4, help="client processes the streams are spread over")
    parser.add_argument("--overhead-steps", type=int, default=300)
    parser.add_argument("--survive-streams", type=int, default=100)
    parser.add_argument("--survive-steps", type=int, default=200)
    parser.add_argument("--survive-pace-ms", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="a CI-safe run of about a minute")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.rounds, args.overhead_steps = 1.5, 1, 100
        args.survive_streams, args.survive_steps = 20, 60
    runtime_dir = Path(tempfile.mkdtemp(prefix="infervisor-streams-")) / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    daemon = start_daemon(config(args.streams), runtime_dir, env=env)
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        rounds = []
        for index in range(args.rounds):
            order = [("stream", False), ("carried", True)][:: 1 if index % 2 == 0 else -1]
            measured = {m: throughput(endpoint, m, c, args.streams, args.seconds, args.procs) for m, c in order}
            rounds.append(measured)
        p99 = {n: throughput(endpoint, "stream", False, n, args.seconds, args.procs) for n in sorted({1, 8})}
        p99[args.streams] = rounds[-1]["stream"]
        report.update(rounds=rounds, p99=p99)
        report["overhead"] = overhead(endpoint, args.overhead_steps, max(2, args.rounds))
        pace = args.survive_pace_ms / 1000.0
        report["survive"] = survive(endpoint, runtime_dir, args.survive_streams, args.survive_steps, pace, args.procs)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    print_table(report, args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    survived = report["survive"]
    return 0 if survived["errors"] == 0 and survived["equal"] == survived["streams"] * survived["steps"] else 1


def print_table(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The three results, each against its target."""
    n = args.streams
    print(f"GRU step (x {FEATURES}, h {HIDDEN}), eager, 1 thread a worker; {args.rounds} round(s) of "
          f"{args.seconds:g} s, {args.procs} client processes")  # fmt: skip
    print(f"{'':<44}{'steps/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for index, measured in enumerate(report["rounds"]):
        for model, label in (("stream", "daemon state, batching on"), ("carried", "client state, batching off")):
            row = measured[model]
            print(f"{f'round {index + 1}: {n} streams, {label}':<44}{row['steps_per_s']:>10.0f}"
                  f"{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}{row['errors']:>8}")  # fmt: skip
    ratios = [r["stream"]["steps_per_s"] / r["carried"]["steps_per_s"] for r in report["rounds"]]
    print(f"steps/s, {n} streams, batching on / client-carried: median x{statistics.median(ratios):.2f} "
          f"(rounds {', '.join(f'x{r:.2f}' for r in ratios)}; target >= x4)")  # fmt: skip
    shown = ", ".join(f"{count} stream{'s' if count > 1 else ''} {row['p99_ms']:.2f} ms"
                      for count, row in sorted(report["p99"].items()))  # fmt: skip
    print(f"P99 per step, daemon state, batching on: {shown}")
    cost = report["overhead"]
    print(f"per-step overhead, one stream vs a stateless call (client carries h): median {cost['stream_ms']:.3f} ms vs "
          f"{cost['call_ms']:.3f} ms = {100 * cost['overhead']:+.1f}% (target <= +10%)")  # fmt: skip
    s = report["survive"]
    events = s["events"]
    print(f"survival: {s['streams']} streams x {s['steps']} steps, kill -9 at step {events.get('killed', '-')}, "
          f"rolling restart from step {events.get('restart', '-')} (done by step {events.get('restarted', 'the end')}) "
          f"of {s['streams'] * s['steps']}: {s['equal']}/{s['answered']} answers equal to the reference, largest "
          f"difference {s['largest_difference']:.3g}, {s['errors']} errors")  # fmt: skip
    for error in s["first_errors"]:
        print(f"  {error}")


if __name__ == "__main__":
    sys.exit(main())
