"""The control socket's commands, one table: each command's name, whether it only reads, what it does, its handler.

A handler gets the daemon as a `ControlHost` (what the arbiter offers a command) and the command's map,
and returns the answer map. Adding a command is one handler and one `CONTROL_COMMANDS` entry (a read-only one is
also named in infervisor/protocol/constants.py's STATUS_SOCKET_COMMANDS, which the control client routes by); the
unknown-command error, status.sock's read-only set and docs/protocol.md's list all come from the table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only, and no cycle: none of these imports this module
    from infervisor.supervisor.core.fallback_control import FallbackControl
    from infervisor.supervisor.core.reloader import ConfigReloader
    from infervisor.supervisor.lifecycle.pool import WorkerPool


class ControlHost(Protocol):
    """What a control command may ask of the daemon: its parts, its status document and its metrics text."""

    @property
    def pool(self) -> WorkerPool: ...

    @property
    def reloader(self) -> ConfigReloader: ...

    @property
    def fallback(self) -> FallbackControl: ...

    def status(self) -> dict[str, Any]: ...

    def metrics_text(self) -> str: ...

    def start_profile(self, model: str, requests: int) -> dict[str, Any]: ...


Handler = Callable[[ControlHost, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class ControlCommand:
    """One control command: `read_only` ones are answered on status.sock too and while the daemon stops."""

    name: str
    read_only: bool
    summary: str
    handle: Handler


def _profile(host: ControlHost, command: dict[str, Any]) -> dict[str, Any]:
    model, requests = command.get("model"), command.get("requests", 50)
    if not isinstance(model, str) or type(requests) is not int or not 1 <= requests <= 10_000:
        return {"ok": False, "error": "profile needs model (a string) and requests (1..10000)"}
    return host.start_profile(model, requests)


def _restart(host: ControlHost, command: dict[str, Any]) -> dict[str, Any]:
    model = command.get("model")
    if model is not None and model not in host.pool.roster.members:
        return {"ok": False, "error": f"no model {str(model)[:128]!r}; serving {sorted(host.pool.roster.members)}"}
    # The operator's restart also retries builds that overran the compile limit (after `infervisor build`).
    return {"ok": True, "queued": host.pool.restart(model, "operator command", forget_overruns=True)}


CONTROL_COMMANDS: Mapping[str, ControlCommand] = {
    command.name: command
    for command in (
        ControlCommand("status", True, "the status document", lambda host, _: host.status()),
        ControlCommand("ping", True, "is the daemon's loop turning", lambda host, _: {"ok": True, "pid": os.getpid()}),
        ControlCommand("metrics", True, "the Prometheus text", lambda h, _: {"ok": True, "text": h.metrics_text()}),
        ControlCommand("restart", False, "rolling restart of one model or all", _restart),
        ControlCommand("reload", False, "re-read config.json now", lambda host, _: host.reloader.command()),
        ControlCommand("profile", False, "torch.profiler over a worker's next requests", _profile),
        ControlCommand("fallback", False, "a model down its chain, or back", lambda h, c: h.fallback.command(c)),
    )
}


def read_only_commands() -> frozenset[str]:
    """What status.sock answers to the socket group (read from the table when asked, so a test may extend it)."""
    return frozenset(name for name, command in CONTROL_COMMANDS.items() if command.read_only)


def dispatch(
    host: ControlHost, command: dict[str, Any], table: Mapping[str, ControlCommand] | None = None
) -> dict[str, Any]:
    """The answer to one command map: its handler's, or why it is refused (unknown, or a change while stopping)."""
    table = CONTROL_COMMANDS if table is None else table
    name = command.get("cmd")
    found = table.get(name) if isinstance(name, str) else None
    if found is None:
        return {"ok": False, "error": f"unknown command {str(name)[:64]!r}; known: {', '.join(table)}"}
    if host.pool.stop.stopping and not found.read_only:
        return {"ok": False, "error": "the daemon is stopping"}
    return found.handle(host, command)
