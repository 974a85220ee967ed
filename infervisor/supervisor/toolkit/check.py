"""optimize's final check: the chosen chain and layout served by a real daemon, under probe's own paced load.

In process there is no broker hop, no reply path and no supervisor competing for the cores, so
the in-process P99 is not what `infervisor probe` later sees against the served model. The check
starts `infervisor serve` on the config as it would be written, offers the QPS the promise is
made for with the same load generator probe uses, and reports that P99: the one optimize promises.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.supervisor.toolkit.inputs import inputs_at
from infervisor.supervisor.toolkit.load import closed_loop, paced_load
from infervisor.supervisor.toolkit.probe import quantile
from infervisor.supervisor.toolkit.scratch import ScratchDaemon, ScratchFailed, scratch_config, scratch_daemon
from infervisor.supervisor.toolkit.served_sizes import ServedSizes, shapes_of


class CheckFailed(ScratchFailed):
    """The daemon did not start, or the model never served; the message says why (and where its log is kept)."""


@dataclass(frozen=True)
class DaemonCheck:
    """What the served model did under the paced load, and at saturation."""

    qps: float
    clients: int
    seconds: float
    samples: int
    errors: int
    p50_ms: float
    p99_ms: float
    #: Requests per second the daemon answered with `2 x workers` clients sending back to back.
    saturated_qps: float
    #: The profile each worker serves.
    profiles: list[str]
    #: The shapes of the requests sent, in turn (the served sizes), and what they are.
    inputs: list[dict[str, list[int]]]
    measured_at: str


def _wait_serving(daemon: ScratchDaemon, model: str, timeout: float) -> list[str]:
    """The profiles of the model's workers once every one of them serves."""

    def profiles(status: dict[str, Any]) -> tuple[list[str], str] | None:
        workers = status.get("models", {}).get(model, {}).get("workers", [])
        given_up = [w for w in workers if w["state"] == "failed"]
        if given_up:  # the daemon stopped respawning it: waiting longer only hides the reason
            first = given_up[0]
            return [], f"{model} slot {first['slot']} failed: {first.get('load_error') or first.get('last_exit')}"
        if workers and all(w["state"] == "serving" for w in workers):
            return [str(w["profile"]) for w in workers], ""
        return None

    try:
        served, given_up = daemon.await_status(profiles, timeout, f"{model} was not served by every worker")
    except ScratchFailed as exc:
        raise CheckFailed(exc.reason, exc.log_path) from None
    if given_up:
        raise CheckFailed(given_up, daemon.log_path)
    return served


def check(
    raw: dict[str, Any],
    model: str,
    source_dir: Path,
    cache_dir: Path,
    load: tuple[float | None, int, float],
    timeout: float,
    sizes: ServedSizes,
) -> DaemonCheck:
    """Serve `raw` (a config whose models are found in `source_dir`), saturate `model`, then offer it the QPS of
    `load` (qps, clients, seconds) as probe would.

    Without a QPS, half of what the daemon sustained: a load it serves with room to spare. The requests carry
    `sizes` in turn.
    """
    qps, clients, seconds = load
    with scratch_daemon(scratch_config(raw, cache_dir), source_dir, "optimize") as daemon:
        profiles = _wait_serving(daemon, model, timeout)
        entry = raw["models"][model]
        inputs = [inputs_at(entry["inputs"], shapes, seed) for seed, shapes in enumerate(sizes.shapes)]
        endpoint = f"ipc://{daemon.runtime_dir / CLIENT_SOCKET_NAME}"
        # Warm the request path (sockets, first replies) as a daemon serving for a while has it.
        closed_loop(endpoint, model, inputs, 1, 1.0)
        answered, _ = closed_loop(endpoint, model, inputs, 2 * int(entry.get("workers", 1)), seconds)
        qps = qps or max(1.0, round(answered / seconds / 2.0, 1))
        samples, errors = paced_load(endpoint, model, inputs, qps, seconds, clients)
        if not samples:
            raise CheckFailed(f"no request succeeded under {qps:g} QPS ({errors} errors)", daemon.log_path)
    trips = [s.stages()["round_trip"] for s in samples]
    return DaemonCheck(
        qps, clients, seconds, len(samples), errors, round(quantile(trips, 50), 3), round(quantile(trips, 99), 3),
        round(answered / seconds, 1), profiles, [shapes_of(arrays) for arrays in inputs], sizes.text,
    )  # fmt: skip
