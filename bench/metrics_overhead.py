"""What metrics cost the request path: the transport benchmark's tiny 8-client row, metrics off and on, alternating.

    python bench/metrics_overhead.py --baseline DIR [--pairs 4] [--seconds 5] [--clients 8] [--lead 20]
                                     [--scrape-every 1]

"off" is the daemon of another checkout (`--baseline`, e.g. a worktree of the commit before metrics),
"on" this tree's daemon with `metrics_listen` set and this process scraping it every
`--scrape-every` seconds (Prometheus scrapes every 15-60 s: 1 s is the hard case). Without
`--baseline`, "off" is this tree without `metrics_listen`: the request times are recorded either
way (`infervisor metrics` reads them), so that compares the endpoint and its scrapes only.

The runs alternate off/on, each pair in turn reversed (ABBA), so a drift of the machine's load
falls on both sides; the table gives every run and the medians, and the ratio on/off. Besides
req/s, each run reports the supervisor's CPU time per reply during the load (every thread: the
loop, ZeroMQ's I/O, the metrics server): on a box other work keeps busy, req/s moves with that
work, while the CPU the daemon spends per reply still shows what metrics add.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import builtin_entry, start_daemon  # noqa: E402
from bench.transport import client_loop  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _scraper(url: str, every: float, stop: threading.Event, counts: list[int]) -> None:
    """GET /metrics every `every` seconds until stopped; counts the scrapes that answered 200."""
    while not stop.wait(every):
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                response.read()
                counts[0] += response.status == 200
        except OSError:
            counts[1] += 1


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process, every thread of it."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _sample_cpu(pid: int, start_at: float, stop_at: float, out: list[float]) -> None:
    """The daemon's CPU seconds at the start and the end of the load window."""
    for moment in (start_at, stop_at):
        time.sleep(max(0.0, moment - time.time()))
        out.append(_cpu_s(pid))


def run_clients(
    endpoint: str, daemon_pid: int, clients: int, seconds: float, lead_s: float
) -> tuple[list[float], int, float]:
    """transport.py's raw-socket clients, all starting `lead_s` from now (on a loaded box a spawn takes seconds).

    Returns the latencies, the errors, and the supervisor's CPU seconds during the load.
    """
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + lead_s
    cpu: list[float] = []
    sampler = threading.Thread(target=_sample_cpu, args=(daemon_pid, start_at, start_at + seconds, cpu), daemon=True)
    sampler.start()
    pipes, procs = [], []
    for _ in range(clients):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=client_loop, args=(endpoint, "tiny", seconds, start_at, "raw", sender))
        proc.start()
        pipes.append(receiver)
        procs.append(proc)
    latencies: list[float] = []
    errors = 0
    late = 0
    for receiver in pipes:
        got, _, errs = receiver.recv()
        latencies.extend(got)
        errors += errs
        late += not got
    for proc in procs:
        proc.join(30)
    sampler.join(30)
    if late:
        raise SystemExit(f"{late} of {clients} clients were not ready within --lead {lead_s:g} s: raise it")
    return latencies, errors, cpu[1] - cpu[0]


def one_run(variant: str, args: argparse.Namespace, tmp: Path, index: int) -> dict[str, Any]:
    """Start the variant's daemon, run the clients, stop it; its req/s and latencies."""
    port = _free_port()
    metrics = variant == "on"
    config: dict[str, Any] = {
        "log_level": "warning",
        "oversubscribe": True,
        "models": {"tiny": builtin_entry("tiny", workers=1, queue_size=1024, prefetch=4)},
    }
    if metrics:
        config["metrics_listen"] = f"127.0.0.1:{port}"
    root = ROOT if metrics or args.baseline is None else Path(args.baseline).resolve()
    runtime_dir = tmp / f"run-{index}-{variant}"
    daemon = start_daemon(config, runtime_dir, root=root)
    stop = threading.Event()
    scrapes = [0, 0]
    thread = None
    if metrics:
        url = f"http://127.0.0.1:{port}/metrics"
        thread = threading.Thread(target=_scraper, args=(url, args.scrape_every, stop, scrapes), daemon=True)
        thread.start()
    try:
        endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
        latencies, errors, cpu_s = run_clients(endpoint, daemon.pid, args.clients, args.seconds, args.lead)
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    return {
        "variant": variant,
        "req_s": len(latencies) / args.seconds,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "errors": errors,
        # What the supervisor spent per reply, every thread included: far less sensitive than req/s to a busy box.
        "cpu_us_per_req": cpu_s / max(1, len(latencies)) * 1e6,
        "scrapes": scrapes[0],
        "scrape_failures": scrapes[1],
    }


def main() -> int:
    """Alternate the two variants and print every run, the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a checkout without metrics: its daemon is the 'off' side")
    parser.add_argument("--pairs", type=int, default=4, help="off/on pairs")
    parser.add_argument("--seconds", type=float, default=5.0, help="load per run")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client processes")
    parser.add_argument("--lead", type=float, default=20.0, help="seconds the clients get to start before the load")
    parser.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes of the 'on' side")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="infervisor-metrics-bench-"))
    runs: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        order = ("off", "on") if pair % 2 == 0 else ("on", "off")
        for variant in order:
            runs.append(one_run(variant, args, tmp, len(runs)))
            r = runs[-1]
            print(
                f"run {len(runs):>2} {variant:<3} {r['req_s']:>9.1f} req/s  p50 {r['p50_ms']:.3f} ms  "
                f"supervisor {r['cpu_us_per_req']:.1f} us CPU/req  "
                f"p99 {r['p99_ms']:.3f} ms  errors {r['errors']}  "
                f"scrapes {r['scrapes']} (failed {r['scrape_failures']})",
                flush=True,
            )
    off = statistics.median(r["req_s"] for r in runs if r["variant"] == "off")
    on = statistics.median(r["req_s"] for r in runs if r["variant"] == "on")
    off_p50 = statistics.median(r["p50_ms"] for r in runs if r["variant"] == "off")
    on_p50 = statistics.median(r["p50_ms"] for r in runs if r["variant"] == "on")
    off_cpu = statistics.median(r["cpu_us_per_req"] for r in runs if r["variant"] == "off")
    on_cpu = statistics.median(r["cpu_us_per_req"] for r in runs if r["variant"] == "on")
    side = f"baseline {args.baseline}" if args.baseline else "this tree without metrics_listen"
    print(f"off ({side}): median {off:.1f} req/s, p50 {off_p50:.3f} ms, supervisor {off_cpu:.1f} us CPU/req")
    print(
        f"on (this tree, metrics_listen, a scrape every {args.scrape_every:g} s): "
        f"median {on:.1f} req/s, p50 {on_p50:.3f} ms, supervisor {on_cpu:.1f} us CPU/req"
    )
    print(
        f"ratio on/off: req/s x{on / off:.3f}, p50 x{on_p50 / off_p50:.3f}, supervisor CPU/req x{on_cpu / off_cpu:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
