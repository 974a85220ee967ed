"""`infervisor bench`: every optimisation profile of a model, in process and through the daemon, as one table.

A model is a built-in or any model of a config file (--config). The supervisor never imports torch:
the in-process half runs in `python -m infervisor.worker.bench` children (pinned like workers), and the daemon
half starts `infervisor serve` with one worker per profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from infervisor.common.builtin_models import BUILTIN_MODELS
from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.protocol.client import Client
from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.protocol.control_client import ControlError, control_request
from infervisor.protocol.errors import InferenceError
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.observe.stats import percentile
from infervisor.supervisor.settings.config import ConfigError, load_config
from infervisor.supervisor.settings.config_path import ConfigPathError, resolve_config_path
from infervisor.supervisor.toolkit.constraints import ConstraintsError, load_constraints
from infervisor.supervisor.toolkit.inputs import inputs_at
from infervisor.supervisor.toolkit.models import Measured, UnknownModel, resolve
from infervisor.supervisor.toolkit.scratch import ScratchDaemon, ScratchFailed, scratch_config, scratch_daemon
from infervisor.supervisor.toolkit.served_sizes import ServedSizes, recorded_mix, served_sizes


def sizes_of(target: Measured, args: argparse.Namespace, records: Path | None) -> ServedSizes | None:
    """The sizes a configured model is measured at (served_sizes: --constraints' data.inputs, else its
    typical_shape, else the served mix its daemon recorded in `records`, else the declared example); None for a
    built-in, whose only open dim is the batch."""
    if target.model is None:
        return None
    data = load_constraints(Path(args.constraints)).data if args.constraints else None
    recording = None
    if records is not None and target.model.record_inputs:
        recording, why_not = recorded_mix(records, target.name, target.model.record_inputs_mb)
        if why_not:
            print(f"infervisor bench: {why_not}", file=sys.stderr)
    return served_sizes(target.model.inputs, data, target.model.typical_shape, recording)


def in_process(
    target: Measured, threads: int, args: argparse.Namespace, cache_dir: Path, sizes: ServedSizes | None = None
) -> tuple[list[Any], list[dict[str, Any]]]:
    """The input spec and one row per profile, from a pinned `python -m infervisor.worker.bench` child."""
    launch = target.launch(threads, cache_dir)
    if launch is not None and args.channels_last:
        launch = dataclasses.replace(launch, channels_last=True)
    model = ["--launch", launch.to_json()] if launch is not None else ["--model", target.name]
    command = [
        sys.executable, "-P", "-m", "infervisor.worker.bench", *model, "--profiles", args.profiles,
        "--threads", str(threads), "--batch", str(args.batch), "--seconds", str(args.seconds),
        "--cache-dir", str(cache_dir),
    ]  # fmt: skip
    if args.channels_last:
        command.append("--channels-last")
    if sizes is not None:
        command += ["--sizes", json.dumps(sizes.as_json())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"infervisor.worker.bench failed ({done.returncode}): {done.stderr[-2000:]}")
    return lines[0]["inputs"], lines[1:]


def _serving(daemon: ScratchDaemon, old_pid: int | None, timeout: float) -> dict[str, Any]:
    """The one worker once it serves (a different process than old_pid)."""

    def new_worker(status: dict[str, Any]) -> dict[str, Any] | None:
        workers = [w for m in status.get("models", {}).values() for w in m["workers"]]
        ready = [w for w in workers if w["state"] == "serving" and w["pid"] != old_pid]
        return dict(ready[0]) if ready else None

    return daemon.await_status(new_worker, timeout, "no serving worker")


def _timed(endpoint: str, model: str, turns: list[dict[str, Any]], seconds: float) -> list[float]:
    """Batch-1 round trips (ms) for `seconds`, at least five, after three untimed ones; the inputs taken in turn."""
    latencies: list[float] = []
    with Client(endpoint) as client:
        for arrays in [*turns, *turns, *turns][:3]:
            client.infer(model, arrays, timeout=60)
        stop = time.monotonic() + seconds
        while time.monotonic() < stop or len(latencies) < 5:
            arrays = turns[len(latencies) % len(turns)]
            started = time.perf_counter()
            client.infer(model, arrays, timeout=60)
            latencies.append((time.perf_counter() - started) * 1000.0)
    return latencies


def through_daemon(
    target: Measured, profile: str, threads: int, args: argparse.Namespace, cache_dir: Path, sizes: ServedSizes | None
) -> dict[str, Any]:
    """Cold start (first and restarted worker) and batch-1 round trip of one profile served by the daemon."""
    model = target.name
    model_entry = {
        **target.entry, "workers": 1, "cores_per_worker": threads, "threads": None, "use_smt": False,
        "profiles": [profile], "pick": "first",
        "channels_last": args.channels_last or bool(target.entry.get("channels_last", False)),
        # The bench reports accuracy itself; the daemon must serve the profile even where it would refuse it.
        "tolerance": {"min_cosine": -1.0},
    }  # fmt: skip
    config = scratch_config({"oversubscribe": True, "models": {model: model_entry}}, cache_dir)
    with scratch_daemon(config, target.source_dir or cache_dir, "bench") as daemon:
        first = _serving(daemon, None, args.timeout)
        control_request(daemon.runtime_dir, {"cmd": "restart"})
        again = _serving(daemon, first["pid"], args.timeout)
        if again["profile"] != profile:  # a build that failed in the daemon would otherwise be labelled `profile`
            raise daemon.failure(f"the daemon served {again['profile']} instead of {profile}: "
                                 f"{again['profile_skipped']}")  # fmt: skip
        endpoint = f"ipc://{daemon.runtime_dir / CLIENT_SOCKET_NAME}"
        spec = target.entry["inputs"]
        shapes = sizes.shapes if sizes is not None else ({i["name"]: _batch_one(i["shape"]) for i in spec},)
        turns = [inputs_at(spec, shape, seed) for seed, shape in enumerate(shapes)]
        latencies = _timed(endpoint, model, turns, args.seconds)
        served = _serving(daemon, first["pid"], args.timeout)
    return {
        "ready_s": round(first["ready_ms"] / 1000.0, 2),
        "restart_ready_s": round(again["ready_ms"] / 1000.0, 2),
        "restart_build": again["profile_build"],
        "daemon_p50_ms": percentile(latencies, 50),
        "daemon_p95_ms": percentile(latencies, 95),
        "daemon_p99_ms": percentile(latencies, 99),
        # The restarted (cached-start) worker after the timed requests: what one more worker of this profile costs.
        "pss_mb": round(served["pss"] / 2**20, 1) if served.get("pss") else None,
    }


def _batch_one(shape: list[Any]) -> tuple[int, ...]:
    """A built-in's declared shape at batch 1 (its only open dim)."""
    return tuple(d if isinstance(d, int) else 1 for d in shape)


def _cell(value: Any, width: int, digits: int = 2) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}" if isinstance(value, float) else f"{value:>{width}}"


def _ms(value: float | None, width: int) -> str:
    """Milliseconds with three significant digits, so a 0.005 ms model and a 600 ms one both read."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3g}"


def format_table(rows: list[dict[str, Any]], batch: int) -> str:
    """The screen table: one line per model, thread count and profile."""
    per = f"b{batch}/row"
    lines = [
        f"{'model':<9} {'thr':>3} {'profile':<12} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'qps':>8} "
        f"{'b1/row':>8} {per:>8} {'b' + str(batch) + '/b1':>6} {'speedup':>7} {'cosine':>8} {'max err':>8} "
        f"{'build s':>7} {'ready s':>7} {'restart':>7} {'daemon p50':>10} {'added':>6} {'pss MB':>6}"
    ]
    for r in rows:
        head = f"{r['model']:<9} {r['threads']:>3} {r['profile']:<12}"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped'][:150]}")
            continue
        added = r["daemon_p50_ms"] - r["p50_ms"] if r.get("daemon_p50_ms") is not None else None
        per_sample = r.get("per_sample_ms", {})
        one, many = per_sample.get("1"), per_sample.get(str(batch))
        ratio = r.get("batch_ratio")
        lines.append(
            f"{head} {_cell(r['p50_ms'], 8)} {_cell(r['p95_ms'], 8)} {_cell(r['p99_ms'], 8)} {_cell(r['qps'], 8, 1)} "
            f"{_ms(one, 8)} {_ms(many, 8)} {_cell(ratio, 6)} {_cell(r.get('speedup'), 7)} "
            f"{_cell(r['cosine'], 8, 5)} {r['max_abs_error']:>8.2g} {_cell(r['build_s'], 7, 1)} "
            f"{_cell(r.get('ready_s'), 7, 1)} {_cell(r.get('restart_ready_s'), 7, 1)} "
            f"{_cell(r.get('daemon_p50_ms'), 10)} {_cell(added, 6)} {_cell(r.get('pss_mb'), 6, 0)}"
        )
    return "\n".join(lines)


def _targets(args: argparse.Namespace) -> tuple[list[Measured], Path | None]:
    """The models named by --models: a config's models (--config first), else built-ins; UnknownModel otherwise.
    With them, the cache the config's daemon records its served inputs in (None without a config)."""
    names = [name for name in args.models.split(",") if name]
    config, path = None, None
    if args.config or any(name not in BUILTIN_MODELS for name in names):
        path = resolve_config_path(args.config).path
        config = load_config(path)
    records = resolve_cache_dir(config.cache_dir) if config is not None else None
    return [resolve(name, config, path, prefer_config=bool(args.config)) for name in names], records


def run_bench(args: argparse.Namespace) -> int:
    """Measure, print the table, write the JSON; exit 2 when a model or the config is not there."""
    try:
        targets, records = _targets(args)
        measured_at = {target.name: sizes_of(target, args, records) for target in targets}
    except (UnknownModel, ConfigError, ConfigPathError, ConstraintsError) as exc:
        print(f"infervisor bench: {exc}", file=sys.stderr)
        return 2
    allowed = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    for target in targets:
        cache_dir = Path(args.cache_dir) if args.cache_dir else resolve_cache_dir(None)
        for threads in (int(t) for t in args.threads.split(",")):
            if threads > allowed:
                print(f"skipping {threads} threads: only {allowed} CPUs are allowed here", file=sys.stderr)
                continue
            sizes = measured_at[target.name]
            _, measured = in_process(target, threads, args, cache_dir, sizes)
            eager = next((r["p50_ms"] for r in measured if r["profile"] == REFERENCE_PROFILE and "p50_ms" in r), None)
            for row in measured:
                row.update(
                    model=target.name, threads=threads, measured_at=sizes.text if sizes else "the declared shape"
                )
                if "p50_ms" not in row:
                    rows.append(row)
                    continue
                row["speedup"] = round(eager / row["p50_ms"], 2) if eager else None
                if args.daemon:
                    try:
                        row.update(through_daemon(target, row["profile"], threads, args, cache_dir, sizes))
                    except (ScratchFailed, ControlError, InferenceError) as exc:  # a profile not served is a note
                        row["daemon_error"] = str(exc)[:300]
                        print(f"{target.name} {row['profile']}: daemon: {exc}", file=sys.stderr, flush=True)
                rows.append(row)
                print(format_table([row], args.batch).splitlines()[1], file=sys.stderr, flush=True)
    print(format_table(rows, args.batch))
    for name, sizes in measured_at.items():
        print(f"{name} measured at {sizes.text if sizes else 'the declared shape'} (in process and through the daemon)")
    print(
        f"p50/p95/p99 and qps: batch 1 in process; b1/row, b{args.batch}/row: median ms per sample at batch 1 and "
        f"{args.batch}; b{args.batch}/b1: the median over alternating turns of their ratio (below 1: batching pays); "
        "speedup: eager p50 / "
        "p50 at the same threads; build s: building the profile in process (compile, or load from the cache); "
        "ready s / restart: daemon worker spawn to READY, first start and after a restart; added: daemon p50 - "
        "in-process p50; pss MB: the daemon's worker after a restart (a cached start) and the timed requests, by PSS"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
