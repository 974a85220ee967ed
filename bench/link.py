"""Link benchmark: a two-process round trip over ZeroMQ DEALER/ROUTER (ipc) against the worker link (socketpair).

    python bench/link.py [--count 5000] [--size 100] [--gap-us 0]

The supervisor-worker link replaced a ZeroMQ ipc socket (docs/protocol.md, appendix A); this measures
the one thing the choice rests on: how long one small message takes there and back between two
processes, each end a single Python thread as in the daemon. `--gap-us` idles between round trips,
as a sequential client does. One run, one machine: compare the two rows, not absolutes across runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

#: Round trips before timing starts: connection set-up and first-call costs.
_WARMUP = 200


def zmq_echo(endpoint: str, count: int) -> None:
    """The far end over ZeroMQ: a ROUTER answering each message, as the old supervisor socket was."""
    import zmq

    context: zmq.Context[Any] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    for _ in range(count):
        router.send_multipart(router.recv_multipart(copy=False), copy=False)
    router.close(linger=1000)
    context.term()


def link_echo(sock: socket.socket, count: int) -> None:
    """The far end over a link: answer each message with the same frames."""
    link = Link(sock, WORKER_LINK_FRAMES, 2**30)
    answered = 0
    while answered < count:
        link.wait_readable(10.0)
        for frames in link.receive():
            link.send(frames)
            link.flush_blocking(10.0)
            answered += 1


def time_round_trips(round_trip: Callable[[], object], count: int, gap_s: float) -> list[float]:
    """Latencies (ms) of `count` calls after the warm-up ones, idling `gap_s` before each."""
    latencies = []
    for index in range(count + _WARMUP):
        if gap_s:
            time.sleep(gap_s)  # the idle a sequential client leaves between requests: part of what is measured
        started = time.perf_counter()
        round_trip()
        if index >= _WARMUP:
            latencies.append((time.perf_counter() - started) * 1000.0)
    return latencies


def time_zmq(count: int, size: int, gap_s: float) -> list[float]:
    """Round trips (ms) of a DEALER to a ROUTER in another process, over ipc."""
    import zmq

    endpoint = f"ipc://{tempfile.mkdtemp(prefix='infervisor-link-')}/echo.sock"
    peer = multiprocessing.get_context("spawn").Process(target=zmq_echo, args=(endpoint, count + _WARMUP))
    peer.start()
    context: zmq.Context[Any] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    message = [b"h" * 40, b"x" * size]

    def round_trip() -> object:
        dealer.send_multipart(message, copy=False)
        return dealer.recv_multipart(copy=False)

    latencies = time_round_trips(round_trip, count, gap_s)
    peer.join(30)
    dealer.close(linger=0)
    context.term()
    return latencies


def time_link(count: int, size: int, gap_s: float) -> list[float]:
    """Round trips (ms) over a socketpair to another process, framed as the worker link frames them."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # A spawned child gets the socket through multiprocessing's fd passing, as a worker gets its end at exec.
    peer = multiprocessing.get_context("spawn").Process(target=link_echo, args=(theirs, count + _WARMUP))
    peer.start()
    theirs.close()
    link = Link(ours, WORKER_LINK_FRAMES, 2**30)
    message = [b"h" * 40, b"x" * size]

    def round_trip() -> object:
        link.send(message)
        link.flush_blocking(10.0)
        got: list[Any] = []
        while not got:
            link.wait_readable(10.0)
            got = link.receive()
        return got

    latencies = time_round_trips(round_trip, count, gap_s)
    peer.join(30)
    link.close()
    return latencies


def main() -> int:
    """Run both and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--size", type=int, default=100, help="payload bytes besides a 40-byte header frame")
    parser.add_argument("--gap-us", type=float, default=0.0, help="idle time between round trips")
    args = parser.parse_args()
    gap_s = args.gap_us / 1e6
    rows = [
        ("ZeroMQ DEALER/ROUTER, ipc", time_zmq(args.count, args.size, gap_s)),
        ("socketpair link", time_link(args.count, args.size, gap_s)),
    ]
    print(f"{args.count} round trips of a 2-frame message ({args.size} B payload), gap {args.gap_us:.0f} us")
    print(f"{'path':<28} {'p50 us':>8} {'p99 us':>8}")
    p50s = []
    for label, latencies in rows:
        p50, p99 = percentile(latencies, 50) or 0.0, percentile(latencies, 99) or 0.0
        p50s.append(p50)
        print(f"{label:<28} {p50 * 1000:>8.1f} {p99 * 1000:>8.1f}")
    print(f"link / zmq p50: x{p50s[1] / p50s[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
