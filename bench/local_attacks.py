"""Figures of three local attacks on a daemon of checkout `--root`, measured from outside (issue 39).

    python bench/local_attacks.py memory  [--root DIR] [--connections 64] [--frame-mb 16]
    python bench/local_attacks.py metrics [--root DIR] [--idle 4,64]
    python bench/local_attacks.py orphans [--root DIR] [--children 6]

memory:  N connections each send 2 requests whose one 16 MB frame does not match its header (x
         float32[1,16]); the supervisor's RSS (psutil, from outside) idle, at its peak, and 10 s after.
metrics: N idle TCP connections to the metrics port, then one scrape: how long it takes (or times out).
orphans: a model that starts child processes; kill -9 of the supervisor; how many of the model's
         descendants are alive 5 s later.
Run it against an old checkout (`--root /path/to/old`) and this one for before/after.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import zmq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.daemon import builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client_messages import InferRequest, encode_infer  # noqa: E402
from infervisor.protocol.tensors import TensorDesc  # noqa: E402

MB = 2**20


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _stop(process: Any) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except Exception:  # noqa: BLE001 - a stuck daemon is killed, the figures are already taken
            process.kill()


def memory(args: argparse.Namespace, folder: Path) -> None:
    """RSS of the supervisor idle, during, and 10 s after the mismatched-frame burst."""
    config = {"models": {"tiny": builtin_entry("tiny")}}
    run = folder / "run"
    daemon = start_daemon(config, run, root=args.root)
    try:
        supervisor = psutil.Process(daemon.pid)
        idle = supervisor.memory_info().rss
        peak = [idle]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], supervisor.memory_info().rss)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        frame = os.urandom(args.frame_mb * MB)
        header = encode_infer(InferRequest(1, "tiny", (TensorDesc("x", "float32", (1, 16)),)))
        context: zmq.Context[Any] = zmq.Context()
        sockets = []
        for _ in range(args.connections):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{run / 'infer.sock'}")
            sockets.append(sock)
        started = time.monotonic()
        for sock in sockets:
            for _ in range(2):
                sock.send_multipart([b"", header, frame], copy=False)
        answered = 0
        codes: dict[str, int] = {}
        for sock in sockets:
            for _ in range(2):
                if sock.poll(60_000):
                    reply = sock.recv_multipart()
                    answered += 1
                    text = reply[-1].decode("latin-1", "replace")
                    for code in ("INVALID_INPUT", "BAD_REQUEST", "OVERLOADED"):
                        if code in text:
                            codes[code] = codes.get(code, 0) + 1
        burst_s = time.monotonic() - started
        time.sleep(10.0)  # the connections stay open, as an attacker's would
        done.set()
        after = supervisor.memory_info().rss
        for sock in sockets:
            sock.close()
        context.term()
        print(
            f"memory: {args.connections} connections x 2 x {args.frame_mb} MB mismatched frames: answered "
            f"{answered}/{2 * args.connections} {codes} in {burst_s:.1f} s; supervisor RSS idle {idle / MB:.0f} MB, "
            f"peak {peak[0] / MB:.0f} MB, 10 s after {after / MB:.0f} MB"
        )
    finally:
        _stop(daemon)


def metrics(args: argparse.Namespace, folder: Path) -> None:
    """Time of one scrape with N idle connections open to the metrics port."""
    port = _free_port()
    config = {"metrics_listen": f"127.0.0.1:{port}", "models": {"tiny": builtin_entry("tiny")}}
    daemon = start_daemon(config, folder / "run", root=args.root)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        for idle in [int(n) for n in args.idle.split(",")]:
            held = []
            for _ in range(idle):
                try:  # the old endpoint's listen backlog (5) makes later connects wait: each gets 1 s
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                except OSError:
                    break
            started = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    response.read()
                outcome = f"answered in {time.monotonic() - started:.3f} s"
            except OSError as exc:
                outcome = f"failed after {time.monotonic() - started:.1f} s ({exc})"
            for sock in held:
                sock.close()
            print(f"metrics: {idle} idle connections asked, {len(held)} opened: scrape {outcome}")
            time.sleep(6.0)  # the old endpoint's 5 s read timeouts run out before the next round
    finally:
        _stop(daemon)


ORPHAN_FACTORY = """
import subprocess, sys, torch

GRANDCHILD = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
    "time.sleep(60)"

def build():
    # Each child starts a grandchild, as a model's helper processes might; all sleep for a minute.
    for _ in range({children}):
        subprocess.Popen([sys.executable, "-c",
                          GRANDCHILD])
    return torch.nn.Linear(16, 16)
"""


def orphans(args: argparse.Namespace, folder: Path) -> None:
    """Descendants of the model alive 5 s after kill -9 of the supervisor."""
    (folder / "spawner.py").write_text(ORPHAN_FACTORY.format(children=args.children))
    config = {
        "models": {"spawner": {"source": {"python": "spawner:build"},
                               "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}},
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{args.root}:{folder}"}  # the workers import the checkout attacked
    daemon = start_daemon(config, folder / "run", env=env, root=args.root)
    supervisor = psutil.Process(daemon.pid)
    deadline = time.monotonic() + 30
    descendants: list[psutil.Process] = []
    while time.monotonic() < deadline:
        descendants = supervisor.children(recursive=True)
        if len(descendants) >= 1 + 2 * args.children:
            break
        time.sleep(0.1)
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait()
    time.sleep(5.0)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    print(f"orphans: {len(descendants)} descendants before kill -9 of the supervisor, {len(alive)} alive 5 s after")
    for process in alive:
        process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("attack", choices=["memory", "metrics", "orphans"])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose daemon is attacked")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--frame-mb", type=int, default=16)
    parser.add_argument("--idle", default="4,64")
    parser.add_argument("--children", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="infervisor-attack-") as folder:
        {"memory": memory, "metrics": metrics, "orphans": orphans}[args.attack](args, Path(folder))


if __name__ == "__main__":
    main()
