"""What a shadow costs serving, on one machine in one run.

    python bench/shadow.py [--model resnet50] [--candidate int8_dynamic] [--rounds 3] [--seconds 10] [--clients 2]
                           [--json out.json]

One daemon serves the model on eager while the builder's lossy pick (`--candidate`, built in the background) waits
in shadow: `shadow_rows` is set past what the run can compare, so the shadow never ends and nothing switches. Its
`shadow_budget` is switched between the default (0.25 of one core: the shadow on) and 0 (nothing sampled: off) by
live reloads of config.json, alternating ABBA, `--rounds` times each, so both arms run on the same worker process.
Each row: req/s, P50 and P99 of `--clients` closed-loop clients' round trips, and the rows the shadow compared in
the window; the summary gives the median over the rounds of each round's on/off ratio (bench/audit.py `ratios`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.audit import drive, ratios  # noqa: E402
from bench.daemon import builtin_entry, start_daemon, stop_daemon  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

DEFAULT_BUDGET = 0.25
#: More rows than any run compares: the shadow stays on for the whole bench.
ENDLESS_ROWS = 10_000_000


def shadow_of(runtime: Path, model: str) -> dict[str, Any]:
    """The model's shadow in status (empty before the builder has a candidate)."""
    build = control_request(runtime, {"cmd": "status"}, timeout=30.0)["models"][model].get("build") or {}
    return build.get("shadow") or {}


def set_budget(config: dict[str, Any], config_path: Path, runtime: Path, model: str, budget: float) -> None:
    """Reload config.json with the model's shadow budget and wait until the reload is applied."""
    config["models"][model]["shadow_budget"] = budget
    config_path.write_text(json.dumps(config))
    answer = control_request(runtime, {"cmd": "reload"}, timeout=30.0)
    if not answer.get("ok"):
        raise SystemExit(f"reload refused: {answer}")


def wait_for_shadow(endpoint: str, runtime: Path, model: str, candidate: str) -> None:
    """Drive light traffic until the candidate is in shadow and its process compares rows."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        drive(endpoint, model, 1.0, 1)
        shadow = shadow_of(runtime, model)
        if shadow.get("profile") == candidate and shadow.get("rows_compared", 0) > 0:
            return
    raise SystemExit(f"{model}'s {candidate} never reached its shadow in 900 s: {shadow_of(runtime, model)}")


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Alternating shadow on/off windows of one model on one daemon."""
    model, runtime = args.model, work / "shadow"
    entry = builtin_entry(model, profiles=[args.candidate, "eager"], build="background", shadow_rows=ENDLESS_ROWS,
                          workers=1, cores_per_worker=1)  # fmt: skip
    config: dict[str, Any] = {"cache_dir": str(work / "cache"), "models": {model: entry}}
    config_path = runtime.parent / f"{runtime.name}-config.json"
    process = start_daemon(config, runtime)
    endpoint = f"ipc://{runtime / CLIENT_SOCKET_NAME}"
    rows: list[dict[str, Any]] = []
    try:
        wait_for_shadow(endpoint, runtime, model, args.candidate)
        for round_index in range(args.rounds):
            for arm in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
                set_budget(config, config_path, runtime, model, DEFAULT_BUDGET if arm == "on" else 0.0)
                drive(endpoint, model, 1.0, args.clients)  # the reload's own work is not what the window measures
                before = shadow_of(runtime, model).get("rows_compared", 0)
                rate, latencies = drive(endpoint, model, args.seconds, args.clients)
                row = {"model": model, "shadow": arm, "seconds": args.seconds, "req_s": round(rate, 1),
                       "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
                       "rows_compared": shadow_of(runtime, model).get("rows_compared", 0) - before}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        serving = control_request(runtime, {"cmd": "status"}, timeout=30.0)["models"][model]["serving"]
        if serving != ["eager"]:
            raise SystemExit(f"{model} switched to {serving} during the bench: the arms did not serve the same")
    finally:
        stop_daemon(process)
    return {"rows": rows, "summary": ratios(rows, "shadow", "rows_compared", "compared_rows_per_s")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--candidate", default="int8_dynamic", help="the lossy profile held in shadow")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shadow-bench-") as folder:
        result = measure(args, Path(folder))
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[:3]
    print(json.dumps({"model": args.model, "candidate": args.candidate, "load": load, **result["summary"]}))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
