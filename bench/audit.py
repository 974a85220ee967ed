"""The live audit's cost and its catch time, on one machine in one run.

    python bench/audit.py [--models tiny,resnet50] [--rounds 3] [--seconds 10] [--clients 2] [--catch-rate 10]
                          [--skip-cost] [--skip-catch] [--noise-floor] [--json out.json]

Cost: one daemon per model serving `jit` (an audited profile), driven by `--clients` closed-loop clients for
`--seconds`; the audit is switched on (the default budget, 0.02 of one core) and off (budget 0) by live
reloads of config.json, alternating, `--rounds` times each, so both sides run on the same worker process and
the same machine state. Each row: req/s, P50 and P99 of the client round trip, and the rows audited in the
window; the summary gives the median over the rounds of each round's on/off ratio. `--noise-floor` runs the same
alternation with the audit off on both arms: the ratios it prints are this box's noise, the yardstick for the
audit's.

Catch: tests.evidence_models.OffWhenTraced with the default audit settings (no `audit` key), `jit` validated
on rows where it is exact, then `--catch-rate` requests/s of rows where it is 5% off: the seconds from the
first such request to the audit's fallback (status `fallback.origin == "audit"`) and to eager serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import SHAPES, builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client import Client  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

DEFAULT_BUDGET = 0.02
OFF_SOURCE = {"python": "tests.evidence_models:off_when_traced"}
OFF_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 8]}]


def drive(endpoint: str, model: str, seconds: float, clients: int) -> tuple[float, list[float]]:
    """req/s and round-trip latencies (ms) of `clients` closed-loop clients over `seconds`."""
    name, shape = SHAPES[model]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop_at = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        rng = np.random.default_rng(index)
        with Client(endpoint) as client:
            while time.monotonic() < stop_at:
                x = rng.standard_normal(shape).astype(np.float32)
                started = time.perf_counter()
                client.infer(model, {name: x}, timeout=60.0)
                latencies[index].append((time.perf_counter() - started) * 1000.0)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    every = [ms for own in latencies for ms in own]
    return len(every) / elapsed, every


def set_budget(config: dict[str, Any], config_path: Path, runtime: Path, model: str, budget: float) -> None:
    """Reload config.json with the model's audit budget, and wait until status shows it applied."""
    config["models"][model]["audit"] = {"budget": budget}
    config_path.write_text(json.dumps(config))
    control_request(runtime, {"cmd": "reload"}, timeout=30.0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        audit = control_request(runtime, {"cmd": "status"}, timeout=30.0)["models"][model]["audit"]
        if (audit or {}).get("budget", 0) == budget or (budget == 0 and (audit is None or audit["budget"] == 0)):
            return
        time.sleep(0.2)
    raise SystemExit(f"the budget {budget} of {model} was not applied within 60 s")


def audit_of(runtime: Path, model: str) -> dict[str, Any]:
    return control_request(runtime, {"cmd": "status"}, timeout=30.0)["models"][model].get("audit") or {}


def warm_audit(endpoint: str, runtime: Path, model: str) -> None:
    """Send requests until the audit process audits (its start is not what the rows measure)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        drive(endpoint, model, 1.0, 1)
        audit = audit_of(runtime, model)
        if audit.get("rows_audited") and (audit.get("process") or {}).get("state") == "ready":
            return
    raise SystemExit(f"the audit of {model} never became ready")


def cost(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Alternating audit on/off rows of one model on one daemon."""
    runtime = work / f"cost-{model}"
    config = {"cache_dir": str(work / "cache"), "models": {model: builtin_entry(model, profiles=["jit"],
                                                                                   build="at_start")}}  # fmt: skip
    config_path = runtime.parent / f"{runtime.name}-config.json"
    process = start_daemon(config, runtime)
    endpoint = f"ipc://{runtime / CLIENT_SOCKET_NAME}"
    rows: list[dict[str, Any]] = []
    try:
        drive(endpoint, model, 2.0, args.clients)  # warm caches before the first row
        # --noise-floor: the "on" arm keeps the audit off too, so the ratios show what the box alone varies.
        on_budget = 0.0 if args.noise_floor else DEFAULT_BUDGET
        for round_index in range(args.rounds):
            for arm in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
                budget = on_budget if arm == "on" else 0.0
                set_budget(config, config_path, runtime, model, budget)
                if budget:
                    warm_audit(endpoint, runtime, model)
                before = audit_of(runtime, model).get("rows_audited", 0)
                rate, latencies = drive(endpoint, model, args.seconds, args.clients)
                after = audit_of(runtime, model)
                row = {"model": model, "audit": arm, "seconds": args.seconds,
                       "req_s": round(rate, 1), "p50_ms": percentile(latencies, 50),
                       "p99_ms": percentile(latencies, 99),
                       "rows_audited": after.get("rows_audited", 0) - before if budget else 0,
                       "cost_ms_per_row": after.get("cost_ms_per_row"), "dropped": after.get("dropped", 0)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        process.terminate()
        process.wait(60)
    return {"rows": rows, "summary": ratios(rows)}


def ratios(
    rows: list[dict[str, Any]], arm: str = "audit", work: str = "rows_audited", per_s: str = "audited_rows_per_s"
) -> dict[str, float]:
    """Median over the rounds of each round's on/off ratio (req/s: above 1 is faster with the audit; P99: slower).

    `arm`: the row's key saying "on" or "off"; `work`: its count of rows the audit (or shadow) ran in the window,
    summarised per second of the "on" windows as `per_s`.

    Each round's two windows are adjacent, so a ratio within a round cancels the drift of a shared box's speed over
    the run (seen here: req/s falling by a third mid-run on both arms), which a ratio of the arms' medians does not.
    """
    rounds = [rows[index : index + 2] for index in range(0, len(rows) - 1, 2)]

    def paired(key: str) -> float:
        per_round = []
        for pair in rounds:
            on, off = (next(r for r in pair if r[arm] == side) for side in ("on", "off"))
            per_round.append(on[key] / off[key])
        return round(float(np.median(per_round)), 3)

    on = [r for r in rows if r[arm] == "on"]
    return {
        "req_s_on_over_off": paired("req_s"),
        "p99_on_over_off": paired("p99_ms"),
        "p50_on_over_off": paired("p50_ms"),
        per_s: round(float(np.median([r[work] / r["seconds"] for r in on])), 2),
    }


def catch(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Seconds from the first off request to the audit's fallback, with the default audit settings."""
    runtime = work / "catch"
    validation = work / "validation.npz"
    exact = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    exact[:, 0] = -0.5
    np.savez(validation, x=exact)
    entry = {"source": OFF_SOURCE, "inputs": OFF_INPUTS, "profiles": ["jit", "eager"], "build": "at_start",
             "validation": str(validation)}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = start_daemon({"cache_dir": str(work / "cache"), "models": {"off": entry}}, runtime, env=env)
    endpoint = f"ipc://{runtime / CLIENT_SOCKET_NAME}"
    rng = np.random.default_rng(1)
    fallen = eager = None
    started = time.monotonic()
    sent = 0
    try:
        with Client(endpoint) as client:
            while time.monotonic() - started < 600 and eager is None:
                x = rng.standard_normal((1, 8)).astype(np.float32)
                x[0, 0] = 1.5
                client.infer("off", {"x": x}, timeout=60.0)
                sent += 1
                status = control_request(runtime, {"cmd": "status"}, timeout=30.0)["models"]["off"]
                now = time.monotonic() - started
                if fallen is None and (status.get("fallback") or {}).get("origin") == "audit":
                    fallen = now
                    print(json.dumps({"fallback": status["fallback"]["reason"]}), flush=True)
                if fallen is not None and status["serving"] == ["eager"]:
                    eager = now
                time.sleep(max(0.0, sent / args.catch_rate - (time.monotonic() - started)))
    finally:
        process.terminate()
        process.wait(60)
    return {"rate_req_s": args.catch_rate, "fallback_s": fallen, "eager_serving_s": eager, "requests": sent}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,resnet50")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--catch-rate", type=float, default=10.0)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-catch", action="store_true")
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="both arms with the audit off: the on/off ratios the box gives by itself",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as folder:
        work = Path(folder)
        if not args.skip_catch:
            results["catch"] = catch(args, work)
            print(json.dumps({"catch": results["catch"]}), flush=True)
        if not args.skip_cost:
            results["cost"] = {model: cost(model, args, work) for model in args.models.split(",")}
            for model, result in results["cost"].items():
                print(json.dumps({"model": model, **result["summary"]}), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
