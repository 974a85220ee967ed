"""What the warm template saves: each child's memory and a killed worker's way back, template on against off.

    python bench/process_tree.py [--config configs/default.json] [--rounds 2] [--requests 50] [--kills 3]
                                 [--idle-s 25] [--baseline DIR --baseline-config FILE]

Each round starts the daemon on the same config and cache with `warm_template` on and off (the order reversed
every other round, so a box that slows mid-run weighs on the arms alike). With `--baseline`, a third arm, "baseline",
starts the daemon of another checkout (a git worktree of the commit before a change, set up with its own
`./dev setup all`) on FILE: the same models in the form that checkout reads, with its own cache_dir (the formats
differ).

Each start waits until every worker serves and no build is running, sends `--requests` batch-1 requests to every
model, waits until no audit process is still starting (an exec'd one at idle priority is still importing torch
after the requests) and `--idle-s` more (the template pages out what only it holds once forks pause), reads
/proc/PID/smaps_rollup of every process of the daemon's tree (workers, audit processes, the template, the
supervisor), then kills a serving worker with SIGKILL `--kills` times and times how long until its slot serves again
(a new process past READY) and a request of the model is answered; "minus load" is that time less the new worker's
own model load (its READY's `load_ms`), the part a warm template can shorten.

Run it on a warm cache (one start of the config before, or `infervisor build`) so that every arm loads the same
packages; a cold cache makes the first arm build them. This tree's arms run each model with `shadow: "off"`: they
serve the pick at once, whatever passes the cache has recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.daemon import start_daemon, stop_daemon  # noqa: E402
from bench.memory import smaps_rollup  # noqa: E402
from infervisor.protocol.client import Client  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.supervisor.toolkit.inputs import random_inputs  # noqa: E402

MB = 2**20
#: Seconds after the last child started before the tree is read: past the template's own quiet time before it
#: pages out the import pages no child maps.
IDLE_S = 25.0
#: The arms in the order a round starts them (the next round reversed).
ARMS = ("on", "off", "baseline")
#: A background build in these states will still replace the workers.
BUSY_BUILDS = ("waiting", "building")


def _status(runtime_dir: Path) -> dict[str, Any]:
    return control_request(runtime_dir, {"cmd": "status"}, timeout=10.0)


def _settled(runtime_dir: Path, timeout: float) -> dict[str, Any]:
    """Status once every worker serves and no background build runs (a builder's pick switch is over)."""
    deadline = time.monotonic() + timeout
    while True:
        status = _status(runtime_dir)
        workers = [w for m in status["models"].values() for w in m["workers"]]
        building = [m for m in status["models"].values() if (m.get("build") or {}).get("state") in BUSY_BUILDS]
        rollout = status.get("rollout") or {}
        moving = rollout.get("current") or rollout.get("pending")
        if workers and all(w["state"] == "serving" for w in workers) and not building and not moving:
            return status
        if time.monotonic() > deadline:
            raise SystemExit(f"not settled within {timeout:.0f} s")
        time.sleep(0.5)


def _audits_started(runtime_dir: Path, timeout: float) -> None:
    """Wait until no model's audit process is starting: a half-imported one would be measured at half its size."""
    deadline = time.monotonic() + timeout
    while True:
        audits = [(m.get("audit") or {}).get("process") or {} for m in _status(runtime_dir)["models"].values()]
        if not any(a.get("state") == "starting" for a in audits):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"an audit process still starting after {timeout:.0f} s")
        time.sleep(0.5)


def tree_memory(supervisor: int) -> list[dict[str, Any]]:
    """PSS, private and RSS of the supervisor and every process below it, named by its command line."""
    import psutil

    rows = []
    root = psutil.Process(supervisor)
    for process in [root, *root.children(recursive=True)]:
        try:
            totals = smaps_rollup(process.pid)
            title = " ".join(process.cmdline())
        except (OSError, psutil.Error):
            continue
        kind = "supervisor" if process.pid == supervisor else _kind(title)
        private = totals.get("Private_Clean", 0) + totals.get("Private_Dirty", 0)
        rows.append({"pid": process.pid, "kind": kind, "pss": totals.get("Pss", 0), "private": private,
                     "rss": totals.get("Rss", 0)})  # fmt: skip
    return rows


def _kind(title: str) -> str:
    for module, kind in (("infervisor.worker.template", "template"), ("infervisor.worker.audit", "audit"),
                         ("infervisor.worker.bench", "bench"), ("infervisor.worker", "worker")):  # fmt: skip
        if module in title:
            return kind
    return "other"


def respawn_seconds(runtime_dir: Path, model: str, arrays: dict[str, Any]) -> tuple[float, float]:
    """kill -9 one serving worker of `model`; seconds until its slot serves again (a new process, READY) and a
    request of the model is answered, and the new worker's own load time in them (its READY's `load_ms`, in the
    slot's reason): what the template cannot shorten."""
    victim = _status(runtime_dir)["models"][model]["workers"][0]
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    while time.monotonic() - killed < 120:
        slot = next(w for w in _status(runtime_dir)["models"][model]["workers"] if w["slot"] == victim["slot"])
        if slot["pid"] != victim["pid"] and slot["state"] == "serving":
            with Client(f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}") as client:
                client.infer(model, arrays, timeout=60)
            back = time.monotonic() - killed
            load = re.search(r"\(load (\d+) ms", slot["reason"])
            return back, int(load.group(1)) / 1000.0 if load else float("nan")
        time.sleep(0.01)
    raise SystemExit(f"{model}: slot {victim['slot']} not serving again within 120 s of the kill")


def one_start(config: dict[str, Any], folder: Path, arm: str, requests: int, kills: int,
              root: Path = ROOT, idle_s: float = IDLE_S) -> dict[str, Any]:  # fmt: skip
    """Start the daemon of checkout `root` for one arm (`on`, `off`: this tree's `warm_template`; `baseline`: another
    checkout's daemon on its own config), measure its tree and its respawns, stop it."""
    runtime_dir = folder / f"run-{arm}-{time.monotonic_ns()}"
    if arm != "baseline":
        # The tree measured is the one that serves the pick: with the shadow on, a lossy pick serves only once a pass
        # is recorded in the cache, so which profile the workers hold would depend on the cache's history.
        models = {name: {**entry, "shadow": "off"} for name, entry in config["models"].items()}
        config = {**config, "models": models, "warm_template": arm == "on"}
    process = start_daemon(config, runtime_dir, root=root)
    try:
        status = _settled(runtime_dir, 1800)
        with Client(f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}") as client:
            for name, entry in config["models"].items():
                arrays = random_inputs(entry["inputs"], 1)
                for _ in range(requests):
                    client.infer(name, arrays, timeout=120)
        _audits_started(runtime_dir, 600)
        # The tree at idle: the template pages out what only it holds once forks pause (worker/template.py).
        time.sleep(idle_s)
        memory = tree_memory(process.pid)
        model = next(iter(config["models"]))
        arrays = random_inputs(config["models"][model]["inputs"], 1)
        respawns, loads = [], []
        for _ in range(kills):
            back, load = respawn_seconds(runtime_dir, model, arrays)
            respawns.append(back)
            loads.append(load)
            _settled(runtime_dir, 600)
        profiles = sorted({w["profile"] for m in status["models"].values() for w in m["workers"]})
        return {"arm": arm, "memory": memory, "respawn_s": respawns, "load_s": loads, "profiles": profiles,
                "how": _status(runtime_dir).get("template")}  # fmt: skip
    finally:
        stop_daemon(process)


def _sum(rows: list[dict[str, Any]], kind: str | None, field: str) -> float:
    return float(sum(r[field] for r in rows if kind is None or r["kind"] == kind)) / MB


def summary(results: list[dict[str, Any]]) -> str:
    """One line per arm: medians over rounds of each figure; then the ratios on/off."""
    lines = [f"{'arm':<9} {'served':<18} {'worker PSS':>10} {'worker priv':>11} {'audit PSS':>9} "
             f"{'tpl PSS':>7} {'tree PSS':>8} {'respawn p50 s':>13} {'respawn max s':>13} "
             f"{'minus load p50 s':>16}"]  # fmt: skip
    figures: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue

        def median_of(kind: str | None, field: str, runs: list[dict[str, Any]] = runs) -> float:
            values = []
            for run in runs:
                count = sum(1 for r in run["memory"] if kind is None or r["kind"] == kind) or 1
                per = _sum(run["memory"], kind, field) / (count if kind in ("worker", "audit") else 1)
                values.append(per)
            return statistics.median(values)

        respawns = [s for r in runs for s in r["respawn_s"]]
        beyond = [s - load for r in runs for s, load in zip(r["respawn_s"], r["load_s"], strict=True)]
        figures[arm] = {
            "worker_pss": median_of("worker", "pss"),
            "tree_pss": median_of(None, "pss"),
            "respawn": statistics.median(respawns) if respawns else float("nan"),
        }
        lines.append(
            f"{arm:<9} {','.join(runs[0]['profiles']):<18} {median_of('worker', 'pss'):>10.0f} "
            f"{median_of('worker', 'private'):>11.0f} {median_of('audit', 'pss'):>9.0f} "
            f"{median_of('template', 'pss'):>7.0f} {median_of(None, 'pss'):>8.0f} "
            f"{figures[arm]['respawn']:>13.2f} {max(respawns, default=float('nan')):>13.2f} "
            f"{statistics.median(beyond) if beyond else float('nan'):>16.2f}"
        )
    for base in ("off", "baseline"):
        if "on" in figures and base in figures:
            on, other = figures["on"], figures[base]
            lines.append(
                f"on/{base}: worker PSS x{on['worker_pss'] / other['worker_pss']:.2f}, whole tree PSS "
                f"x{on['tree_pss'] / other['tree_pss']:.2f}, respawn x{on['respawn'] / other['respawn']:.2f}"
            )
    lines.append("(MB per worker / audit process; template, tree: totals; tree = supervisor + every child)")
    return "\n".join(lines)


def _read_config(path: str, cache_dir: str | None) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(Path(path).read_text())
    config["log_level"] = "warning"
    if cache_dir:
        config["cache_dir"] = cache_dir
    return config


def main() -> int:
    """Alternate the arms' starts of one config; print the table (and write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.json"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="seconds after the requests before the read")
    parser.add_argument("--cache-dir", help="the packages' cache (default: the config's)")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--baseline", help="another checkout of the daemon (an older commit's worktree): a third arm")
    parser.add_argument("--baseline-config", help="the same models in the form --baseline's daemon reads")
    args = parser.parse_args()
    if (args.baseline is None) != (args.baseline_config is None):
        parser.error("--baseline and --baseline-config go together")
    config = _read_config(args.config, args.cache_dir)  # one_start derives each arm's own copy
    configs = {"on": config, "off": config}
    roots = {"on": ROOT, "off": ROOT}
    if args.baseline:
        configs["baseline"], roots["baseline"] = _read_config(args.baseline_config, None), Path(args.baseline).resolve()
    arms = [arm for arm in ARMS if arm in configs]
    folder = Path(tempfile.mkdtemp(prefix="infervisor-tree-"))
    results = []
    for round_ in range(args.rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:
            results.append(one_start(configs[arm], folder, arm, args.requests, args.kills, roots[arm], args.idle_s))
            print(f"round {round_ + 1} {arm}: respawn {[round(s, 2) for s in results[-1]['respawn_s']]} s",
                  file=sys.stderr)  # fmt: skip
    print(summary(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
