"""Cold start: from `infervisor serve` to READY=1 with one warm eager worker, and the supervisor's own RSS.

    python bench/cold_start.py [--model resnet50] [--runs 5]

READY=1 is read from a fake NOTIFY_SOCKET, exactly as systemd would see it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import SHAPES, builtin_entry  # noqa: E402


def one_run(model: str, folder: Path) -> tuple[float, float]:
    """Seconds to READY=1 and the supervisor's RSS in MB at that moment."""
    config = {"log_level": "warning", "models": {model: builtin_entry(model, warmup_iterations=1)}}
    (folder / "config.json").write_text(json.dumps(config))
    notify_path = folder / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(120)
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "infervisor", "serve", "--config", str(folder / "config.json"), "--runtime-dir",
         str(folder / "run")],
        cwd=ROOT, env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while b"READY=1" not in notify.recv(4096):
            pass
        ready_s = time.monotonic() - started
        rss_mb = psutil.Process(process.pid).memory_info().rss / 2**20
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        notify.close()
    return ready_s, rss_mb


def main() -> int:
    """Run the cold starts and print median, min and max."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", choices=sorted(SHAPES))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    times, sizes = [], []
    for index in range(args.runs):
        folder = Path(tempfile.mkdtemp(prefix=f"infervisor-cold-{index}-"))
        ready_s, rss_mb = one_run(args.model, folder)
        times.append(ready_s)
        sizes.append(rss_mb)
        print(f"run {index + 1}: READY=1 after {ready_s:.2f} s, supervisor RSS {rss_mb:.0f} MB")
    print(
        f"{args.model}, one eager worker, {args.runs} runs: READY median {statistics.median(times):.2f} s "
        f"(min {min(times):.2f}, max {max(times):.2f}); supervisor RSS median {statistics.median(sizes):.0f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
