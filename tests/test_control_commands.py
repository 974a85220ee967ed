"""The control commands are one table: dispatch, the unknown-command answer and status.sock's set all follow it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from infervisor.protocol.constants import STATUS_SOCKET_COMMANDS
from infervisor.supervisor.core.control_commands import (
    CONTROL_COMMANDS,
    ControlCommand,
    ControlHost,
    dispatch,
    read_only_commands,
)
from tests.conftest import ROOT


class _Pool:
    """The pool as a command sees it: its members, whether it stops, and the restarts it was asked for."""

    def __init__(self, stopping: bool) -> None:
        self.stop = SimpleNamespace(stopping=stopping)
        self.roster = SimpleNamespace(members={"m": []})
        self.restarted: list[str | None] = []

    def restart(self, model: str | None, reason: str, forget_overruns: bool = False) -> int:
        self.restarted.append(model)
        return 1


class _Host:
    """A daemon as a command sees it, recording what it was asked."""

    def __init__(self, stopping: bool = False) -> None:
        self.pool = _Pool(stopping)
        self.asked: list[str] = []

    def status(self) -> dict[str, Any]:
        self.asked.append("status")
        return {"ok": True, "state": "ready"}

    def metrics_text(self) -> str:
        return ""

    def start_profile(self, model: str, requests: int) -> dict[str, Any]:
        return {"ok": True}


def _queue_age(host: ControlHost, command: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "oldest_s": 0.0, "state": host.status()["state"]}


def test_a_command_added_to_the_table_is_answered_and_listed() -> None:
    """One table entry is a whole command: it is dispatched, named among the known ones, and read-only if declared."""
    table = {**CONTROL_COMMANDS, "queue_age": ControlCommand("queue_age", True, "oldest queued request", _queue_age)}
    host = _Host()
    assert dispatch(host, {"cmd": "queue_age"}, table) == {"ok": True, "oldest_s": 0.0, "state": "ready"}
    unknown = dispatch(host, {"cmd": "nope"}, table)
    assert unknown["ok"] is False and unknown["error"].endswith(f"known: {', '.join(table)}")
    assert "queue_age" in unknown["error"]


def test_changes_are_refused_while_stopping_and_reads_are_not() -> None:
    """A stopping daemon still answers status but refuses a restart, without calling its handler."""
    host = _Host(stopping=True)
    assert dispatch(host, {"cmd": "status"})["ok"] is True
    assert dispatch(host, {"cmd": "restart", "model": "m"}) == {"ok": False, "error": "the daemon is stopping"}
    assert host.asked == ["status"] and host.pool.restarted == []


def test_status_sock_answers_what_a_client_sends_it() -> None:
    """The table's read-only commands are the ones the control client routes to status.sock (a protocol constant)."""
    assert read_only_commands() == STATUS_SOCKET_COMMANDS == {"status", "ping", "metrics"}


def test_the_protocol_spec_lists_every_command_of_the_table() -> None:
    """docs/protocol.md's unknown-command answer names the daemon's commands in the table's order."""
    spec = (ROOT / "docs" / "protocol.md").read_text()
    assert f"known: {', '.join(CONTROL_COMMANDS)}" in spec


def test_a_restart_names_a_served_model_or_is_refused() -> None:
    """restart of a served model queues it; of an unknown one it says which models are served."""
    host = _Host()
    assert dispatch(host, {"cmd": "restart", "model": "m"}) == {"ok": True, "queued": 1}
    refused = dispatch(host, {"cmd": "restart", "model": "x"})
    assert refused == {"ok": False, "error": "no model 'x'; serving ['m']"} and host.pool.restarted == ["m"]
