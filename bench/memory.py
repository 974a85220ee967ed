"""What each worker of a config costs in memory, first start (empty cache) against cached start.

    python bench/memory.py --config configs/default.json [--profiles int8_static,eager,aoti] [--requests 50]

For each model of the config and each profile asked (default: the model's own chain and pick), the
daemon starts twice on a fresh cache directory: the first start builds every package, the second
loads them. After `--requests` batch-1 requests each worker's /proc/PID/smaps_rollup is read:

- PSS: shared pages divided among the processes that map them; the workers' PSS add up to what they cost.
- private (USS): pages no other process maps; what one more worker of the model adds to the box.
- RSS: everything resident, shared pages in full; about what the first worker costs alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.daemon import stop_daemon  # noqa: E402
from infervisor.protocol.client import Client  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import await_status, control_request  # noqa: E402
from infervisor.supervisor.toolkit.inputs import random_inputs  # noqa: E402

KB = 1024
MB = 2**20
#: The smaps_rollup fields the table shows, in kB as the kernel writes them.
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Shared_Clean", "Private_Clean", "Private_Dirty", "Anonymous")


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's memory totals in bytes, from /proc/PID/smaps_rollup."""
    totals: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            totals[name.strip()] = int(fields[0]) * KB
    return totals


def serve_and_measure(config: dict[str, Any], folder: Path, requests: int, timeout: float) -> list[dict[str, Any]]:
    """Start the daemon on `config`, send `requests` to every model, return each worker's memory; stop it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    runtime_dir = folder / "run"
    with (folder / "daemon.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "infervisor", "serve", "--config", str(path), "--runtime-dir", str(runtime_dir)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def serving(status: dict[str, Any]) -> dict[str, Any] | None:
            workers = [w for m in status["models"].values() for w in m["workers"]]
            return status if workers and all(w["state"] == "serving" for w in workers) else None

        await_status(process, runtime_dir, serving, timeout, "every worker serving")
        with Client(f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}") as client:
            for name, entry in config["models"].items():
                arrays = random_inputs(entry["inputs"], 1)
                for _ in range(requests):
                    client.infer(name, arrays, timeout=120)
        status = control_request(runtime_dir, {"cmd": "status"}, timeout=10.0)
        rows = []
        for name, model in status["models"].items():
            for worker in model["workers"]:
                rows.append(
                    {
                        "model": name,
                        "slot": worker["slot"],
                        "pid": worker["pid"],
                        "profile": worker["profile"],
                        "ready_s": round(worker["ready_ms"] / 1000.0, 1),
                        "restarted": any(n.startswith("restarted the process") for n in worker["profile_build"]),
                        **smaps_rollup(worker["pid"]),
                    }
                )
        rows.append({"model": "(supervisor)", "pid": process.pid, **smaps_rollup(process.pid)})
        return rows
    finally:
        stop_daemon(process)


def _mb(value: int | None) -> str:
    return f"{value / MB:>7.0f}" if value is not None else f"{'-':>7}"


def table(results: list[tuple[str, str, list[dict[str, Any]]]]) -> str:
    """One line per worker and start: PSS, private, RSS and where the PSS is (anonymous or file pages)."""
    lines = [
        f"{'profile':<12} {'start':<7} {'model':<12} {'slot':>4} {'served':<12} {'ready s':>7} {'PSS MB':>7} "
        f"{'priv MB':>7} {'RSS MB':>7} {'anon':>7} {'file':>7} {'restart':>7}"
    ]
    for profile, start, rows in results:
        for r in rows:
            private = r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)
            lines.append(
                f"{profile:<12} {start:<7} {r['model']:<12} {r.get('slot', ''):>4} {r.get('profile') or '':<12} "
                f"{r.get('ready_s', ''):>7} {_mb(r.get('Pss'))} {_mb(private)} {_mb(r.get('Rss'))} "
                f"{_mb(r.get('Pss_Anon'))} {_mb(r.get('Pss_File'))} {'yes' if r.get('restarted') else '':>7}"
            )
    return "\n".join(lines)


def main() -> int:
    """Measure each profile's workers at a first and a cached start; print the table (and write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.json"))
    parser.add_argument("--profiles", default="", help="comma-separated; each alone as the chain (default: as config)")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take (a first start builds)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--cache-dir", help="keep packages here (not deleted); with --starts cached, reuse them")
    parser.add_argument("--starts", default="first,cached", help="which starts: first (empty cache), cached, or both")
    args = parser.parse_args()
    base = json.loads(Path(args.config).read_text())
    profiles = [p for p in args.profiles.split(",") if p] or ["(config)"]
    results: list[tuple[str, str, list[dict[str, Any]]]] = []
    for profile in profiles:
        scratch = Path(tempfile.mkdtemp(prefix="infervisor-memory-"))
        cache = Path(args.cache_dir) if args.cache_dir else scratch / "cache"
        config = {**base, "cache_dir": str(cache), "log_level": "warning"}
        config["worker_start_timeout_s"] = max(float(config.get("worker_start_timeout_s", 0)), args.timeout)
        config["compile_timeout_s"] = max(float(config.get("compile_timeout_s", 0)), args.timeout)
        if profile != "(config)":
            config["models"] = {
                name: {**entry, "profiles": [profile], "pick": "first"} for name, entry in base["models"].items()
            }
        # What a worker that builds at its own start holds (the background builder is a process of its own).
        config["models"] = {name: {**entry, "build": "at_start"} for name, entry in config["models"].items()}
        try:
            for start in args.starts.split(","):
                if start == "first" and cache.exists() and any(cache.iterdir()):
                    raise SystemExit(f"a first start needs an empty cache dir; {cache} has packages")
                rows = serve_and_measure(config, scratch / start, args.requests, args.timeout)
                results.append((profile, start, rows))
                print(table([(profile, start, rows)]), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print(table(results))
    print(
        f"after {args.requests} batch-1 requests per model; first: an empty cache dir (the workers build), cached: "
        "the same dir again. PSS: shared pages divided among their users; priv: pages only this process maps "
        "(what one more worker adds); RSS: shared pages in full (about what a lone first worker costs)."
    )
    if args.json:
        Path(args.json).write_text(json.dumps([{"profile": p, "start": s, "rows": r} for p, s, r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
