"""A monitor, a control command and a CLI command are each one table entry: fakes registered at run time work whole.

The daemon runs in its own process, so the fake monitor and control command are registered there:
this module, run as `python -m tests.test_extension_tables serve ...`, patches the tables and then
runs the real `infervisor serve` in the same process.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infervisor.supervisor import cli
from infervisor.supervisor.commands import registry as cli_registry
from infervisor.supervisor.commands.registry import CliCommand
from infervisor.supervisor.core import control_commands
from infervisor.supervisor.core.control_commands import ControlCommand, ControlHost
from infervisor.supervisor.monitors import registry
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.registry import MonitorEntry
from infervisor.supervisor.monitors.view import MonitorView
from tests.conftest import TINY_INPUTS, Daemon, model_entry, wait_for


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


def served_models(host: ControlHost, command: dict[str, Any]) -> dict[str, Any]:
    """A fake control command: the names of the models the pool serves."""
    return {"ok": True, "models": sorted(host.pool.roster.members)}


def register_fakes(patch: pytest.MonkeyPatch) -> None:
    """The one monitor entry and the one control-command entry the fakes need, added to the live tables."""
    entry = MonitorEntry("first_worker", "recycles the first serving worker once", FirstWorkerWatch)
    patch.setattr(registry, "MONITORS", (*registry.MONITORS, entry))
    command = ControlCommand("served_models", True, "the models the pool serves", served_models)
    patch.setattr(control_commands, "CONTROL_COMMANDS", {**control_commands.CONTROL_COMMANDS, command.name: command})


@pytest.fixture
def daemon_with_fakes(tmp_path: Path) -> Iterator[Daemon]:
    """A real daemon started through this module, so its tables hold the fake monitor and control command."""
    config = {
        "monitor_interval_s": 0.2,
        "oversubscribe": True,
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)},
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


def test_a_control_command_added_to_the_table_is_answered_over_the_control_socket(
    daemon_with_fakes: Daemon,
) -> None:
    """The fake command answers on the real control.sock, and the unknown-command answer lists it."""
    daemon = daemon_with_fakes
    wait_for(daemon.try_status, 60, "the daemon answering")
    assert daemon.control({"cmd": "served_models"}) == {"ok": True, "models": ["tiny"]}
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
