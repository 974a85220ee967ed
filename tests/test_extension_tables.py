"""A monitor, a control command and a CLI command are each one table entry: fakes registered at run time work whole.

A monitor shown in status and /metrics is its module (here, this file) plus one entry that declares its readings.

The daemon runs in its own process, so the fake monitor and control command are registered there:
this module, run as `python -m tests.test_extension_tables serve ...`, patches the tables and then
runs the real `infervisor serve` in the same process.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infervisor.supervisor import cli
from infervisor.supervisor.commands import registry as cli_registry
from infervisor.supervisor.commands.registry import CliCommand
from infervisor.supervisor.core import control_commands
from infervisor.supervisor.core.control_commands import ControlCommand, ControlHost
from infervisor.supervisor.monitors import registry
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.readings import Reading, Readings, Scope
from infervisor.supervisor.monitors.registry import MonitorEntry, build_monitors
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.config import Config, parse_config
from tests.conftest import ROOT, TINY_INPUTS, Daemon, free_loopback_port, model_entry, wait_for
from tests.fault_models import FAULT_INPUTS


class FirstWorkerWatch:
    """A fake monitor: asks once for the first serving worker it sees to be recycled."""

    def __init__(self) -> None:
        self.fired = False

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """One RECYCLE finding, the first time a worker serves."""
        serving = view.all_serving()
        if self.fired or not serving:
            return []
        self.fired = True
        return [Finding("first_worker", Action.RECYCLE, serving[0], {"reason": "the fake monitor's one finding"})]


class TurnWatch:
    """A fake monitor with readings and no findings: its turns, each model's serving workers, each worker's turns."""

    def __init__(self) -> None:
        self.turns = 0
        self.serving: dict[str, int] = {}
        self.seen: dict[int, int] = {}

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Count; never a finding."""
        self.turns += 1
        self.serving = {name: len(slots) for name, slots in view.serving.items()}
        for slot in view.all_serving():
            if slot.pid is not None:
                self.seen[slot.pid] = self.seen.get(slot.pid, 0) + 1
        self.seen = {pid: turns for pid, turns in self.seen.items() if pid in view.live_pids}
        return []

    def readings(self, config: Config) -> Readings:
        """One value of each scope."""
        return Readings(
            box={"turns": self.turns},
            models={name: {"serving_workers": count} for name, count in self.serving.items()},
            workers={pid: {"turns_seen": turns} for pid, turns in self.seen.items()},
        )


#: One reading of each scope, each with a metric family.
TURN_READINGS = (
    Reading("turns", Scope.BOX, "monitor turns the fake monitor ran", metric="infervisor_fake_turns", counter=True),
    Reading(
        "serving_workers",
        Scope.MODEL,
        "serving workers the fake monitor saw",
        metric="infervisor_fake_serving_workers",
    ),
    Reading(
        "turns_seen",
        Scope.WORKER,
        "monitor turns the fake monitor saw this worker serve",
        metric="infervisor_fake_worker_turns",
        counter=True,
    ),
)


class QueueAgeWatch:
    """docs/architecture.md's sketch, whole: each model's oldest queued request's wait, from the view alone."""

    def __init__(self) -> None:
        self.ages: dict[str, float] = {}

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Keep the ages; never a finding."""
        self.ages = dict(view.queue_ages)
        return []

    def readings(self, config: Config) -> Readings:
        """The oldest wait of each model with requests waiting."""
        return Readings(models={name: {"oldest_s": age} for name, age in self.ages.items()})


QUEUE_AGE_READINGS = (
    Reading(
        "oldest_s",
        Scope.MODEL,
        "how long the oldest queued request has waited",
        metric="infervisor_fake_queue_oldest_seconds",
        unit="seconds",
    ),
)


def served_models(host: ControlHost, command: dict[str, Any]) -> dict[str, Any]:
    """A fake control command: the names of the models the pool serves."""
    return {"ok": True, "models": sorted(host.pool.roster.members)}


def register_fakes(patch: pytest.MonkeyPatch) -> None:
    """The one monitor entry and the one control-command entry the fakes need, added to the live tables."""
    entry = MonitorEntry("first_worker", "recycles the first serving worker once", FirstWorkerWatch)
    turns = MonitorEntry("turns", "counts turns and serving workers (readings only)", TurnWatch, TURN_READINGS)
    ages = MonitorEntry("queue_age", "queued requests' oldest wait", QueueAgeWatch, QUEUE_AGE_READINGS)
    patch.setattr(registry, "MONITORS", (*registry.MONITORS, entry, turns, ages))
    command = ControlCommand("served_models", True, "the models the pool serves", served_models)
    patch.setattr(control_commands, "CONTROL_COMMANDS", {**control_commands.CONTROL_COMMANDS, command.name: command})


@pytest.fixture
def daemon_with_fakes(tmp_path: Path) -> Iterator[Daemon]:
    """A real daemon started through this module, so its tables hold the fake monitor and control command."""
    config = {
        "monitor_interval_s": 0.2,
        "oversubscribe": True,
        "metrics_listen": f"127.0.0.1:{free_loopback_port()}",
        "models": {
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
            "rowslow": model_entry({"python": "tests.fault_models:rowslow"}, FAULT_INPUTS, workers=1),
        },
    }
    daemon = Daemon(tmp_path, config, command_prefix=[sys.executable, "-m", __name__])
    try:
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.log_text()[-3000:]


def test_a_monitor_added_to_the_table_runs_in_the_daemon_and_its_finding_is_acted_on(
    daemon_with_fakes: Daemon,
) -> None:
    """The fake monitor's RECYCLE finding is logged as fired and the worker it named is replaced."""
    daemon = daemon_with_fakes
    wait_for(daemon.try_status, 60, "the daemon answering")

    def fired() -> list[dict[str, Any]]:
        return [e for e in daemon.log_events() if e["event"] == "monitor_fired" and e["monitor"] == "first_worker"]

    (event,) = wait_for(fired, 120, "the fake monitor's finding")
    assert event["action"] == "recycle"

    def replaced() -> bool:
        pool = [w for w in daemon.status()["models"]["tiny"]["workers"] if "role" not in w]
        return all(w["state"] == "serving" and w["pid"] not in (None, event["pid"]) for w in pool)

    wait_for(replaced, 120, "the named worker replaced")


def test_a_monitor_s_readings_declared_on_its_entry_show_in_status_and_metrics(daemon_with_fakes: Daemon) -> None:
    """The fake monitor's box, model and worker readings appear in a real status and in a scrape of /metrics."""
    daemon = daemon_with_fakes
    wait_for(daemon.try_status, 60, "the daemon answering")

    def shown() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, str]] | None:
        status = daemon.status()
        workers = [w for w in status["models"]["tiny"]["workers"] if "role" not in w and w["turns_seen"]]
        if not workers:
            return None
        families = _scrape(status["endpoints"]["metrics"])
        labels = {"model": "tiny", "slot": str(workers[0]["slot"]), "pid": str(workers[0]["pid"])}
        seen = families.get("infervisor_fake_worker_turns")
        # The worker may have been replaced between the two reads (the other fake recycles one): read again then.
        if seen is None or not any(sample.labels == labels for sample in seen.samples):
            return None
        return status, workers[0], families, labels

    status, worker, families, labels = wait_for(shown, 120, "a worker the fake monitor saw serve, in both")
    assert status["turns"] == {"turns": status["turns"]["turns"]} and status["turns"]["turns"] >= 1
    assert status["models"]["tiny"]["serving_workers"] >= 1
    assert worker["turns_seen"] >= 1 and worker["rss"] and worker["pss"]
    turns, serving, seen = (families[name] for name in TURN_READINGS_METRICS)
    assert (turns.type, turns.documentation) == ("counter", "monitor turns the fake monitor ran")
    assert [s.value for s in turns.samples if s.name == "infervisor_fake_turns_total"][0] >= 1
    assert (serving.type, serving.documentation) == ("gauge", "serving workers the fake monitor saw")
    assert sorted(s.labels["model"] for s in serving.samples) == ["rowslow", "tiny"]
    assert [s.value for s in serving.samples if s.labels["model"] == "tiny"][0] >= 1
    assert [s.value for s in seen.samples if s.labels == labels and s.name.endswith("_total")][0] >= 1


def test_a_monitor_reads_the_queues_ages_from_its_view_alone(daemon_with_fakes: Daemon) -> None:
    """With four clients on a one-worker model of 20 ms a request, the queue-age sketch reports a wait in status."""
    daemon = daemon_with_fakes
    daemon.wait_ready()
    done = threading.Event()

    def keep_asking() -> None:
        with daemon.client() as client:
            for _ in range(3000):  # 60 s of requests at most
                if done.is_set():
                    return
                client.infer("rowslow", {"x": np.zeros((1, 2), np.float32)}, timeout=60)

    clients = [threading.Thread(target=keep_asking) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        oldest = wait_for(lambda: daemon.status()["models"]["rowslow"].get("oldest_s"), 60, "a queue age in status")
    finally:
        done.set()
        for client in clients:
            client.join(90)
    # Three requests wait behind the one served: the oldest has waited at least part of a 20 ms turn, and far less
    # than the test's minute.
    assert 0.0 < oldest < 30.0
    assert daemon.status()["models"]["tiny"]["oldest_s"] is None


#: The families of TURN_READINGS, as prometheus_client's parser names them (a counter without `_total`).
TURN_READINGS_METRICS = ("infervisor_fake_turns", "infervisor_fake_serving_workers", "infervisor_fake_worker_turns")


def _scrape(url: str) -> dict[str, Any]:
    """The metric families a GET of /metrics returns, by name."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return {family.name: family for family in text_string_to_metric_families(response.read().decode())}


def test_readings_that_clash_or_a_monitor_without_readings_fail_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two readings with one status key, or an entry declaring readings for a monitor that reports none, refuse."""
    twice = MonitorEntry("turns_again", "the same readings again", TurnWatch, TURN_READINGS)
    turns = MonitorEntry("turns", "counts turns", TurnWatch, TURN_READINGS)
    monkeypatch.setattr(registry, "MONITORS", (*registry.MONITORS, turns, twice))
    with pytest.raises(ValueError, match="monitor 'turns_again': reading 'turns' clashes with monitor 'turns'"):
        build_monitors()
    mute = MonitorEntry("mute", "declares what it cannot report", FirstWorkerWatch, TURN_READINGS)
    monkeypatch.setattr(registry, "MONITORS", (*registry.MONITORS[:-2], mute))
    with pytest.raises(ValueError, match="monitor 'mute' declares readings but has no readings"):
        build_monitors()
    monkeypatch.setattr(registry, "MONITORS", registry.MONITORS[:-1])
    config = parse_config(json.dumps({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}), ROOT)
    assert [sample.name for sample in build_monitors().readings(config)] == ["memory", "thermal", "audit"]


def test_a_control_command_added_to_the_table_is_answered_over_the_control_socket(
    daemon_with_fakes: Daemon,
) -> None:
    """The fake command answers on the real control.sock, and the unknown-command answer lists it."""
    daemon = daemon_with_fakes
    wait_for(daemon.try_status, 60, "the daemon answering")
    assert daemon.control({"cmd": "served_models"}) == {"ok": True, "models": ["rowslow", "tiny"]}
    unknown = daemon.control({"cmd": "nope"})
    assert unknown["ok"] is False and unknown["error"].endswith(", served_models")


def greet_options(parser: argparse.ArgumentParser) -> None:
    """The fake CLI command's one option."""
    parser.add_argument("--name", required=True, help="who to greet")


def run_greet(args: argparse.Namespace) -> int:
    """The fake CLI command: a greeting, and an exit code no real command uses."""
    print(f"hello {args.name}")
    return 7


def test_a_cli_command_added_to_the_table_is_parsed_and_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One entry is a whole command: `infervisor --help` lists it, its option parses and its handler's code returns."""
    command = CliCommand("greet", "say hello", greet_options, f"{__name__}:run_greet")
    monkeypatch.setattr(cli_registry, "CLI_COMMANDS", {**cli_registry.CLI_COMMANDS, command.name: command})
    assert cli.main(["greet", "--name", "operator"]) == 7
    assert capsys.readouterr().out == "hello operator\n"
    assert cli.main(["--help"]) == 0
    assert re.search(r"^ +greet +say hello$", capsys.readouterr().out, re.MULTILINE)
    assert cli.main(["greet"]) == 2
    assert "the following arguments are required: --name" in capsys.readouterr().err


def main() -> int:
    """Run `infervisor serve` with the fakes registered; argv is what conftest's Daemon puts after its prefix."""
    argv = sys.argv[sys.argv.index("serve") :]
    with pytest.MonkeyPatch.context() as patch:
        register_fakes(patch)
        return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
