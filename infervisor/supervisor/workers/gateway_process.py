"""The Open Inference Protocol gateway as the daemon holds it: started, reaped, restarted with back-off, stopped.

Its process and its ends are a `ChildRecord` (child_record.py), its end is noticed by the one reaper
(reaper.py); how long it waits before its next start is lifecycle/exit_decision.py's (`decide_child_exit`),
applied each housekeeping turn by lifecycle/exits.py `keep_gateway` through `exited`, `tick` and `ended`.

The gateway (`python -P -m infervisor.gateway`, infervisor/gateway/) is a client of the broker on the ipc
endpoint, in its own process so HTTP and gRPC never share the broker's loop. It asks the kernel to kill it when
the daemon dies, so even a kill -9 of the daemon leaves no gateway behind.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import structlog

from infervisor.supervisor.settings.config import Config, OipConfig
from infervisor.supervisor.workers.child_home import HOME
from infervisor.supervisor.workers.child_record import ChildRecord
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.retry_policy import ChildKind
from infervisor.supervisor.workers.slot import describe_exit

log = structlog.get_logger("supervisor")

#: The largest request body (HTTP) or message (gRPC) whatever max_frame_bytes says: grpcio's caps are C ints.
_MAX_BODY_BYTES = 2**31 - 1
#: How long a stopping gateway has to close its listeners before SIGKILL.
_STOP_GRACE_S = 2.0


class GatewayState(enum.Enum):
    """Where the gateway stands (status `endpoints.oip.state`)."""

    OFF = "off"  # no `oip` in the config
    RUNNING = "running"
    BACKOFF = "backoff"  # ended unasked: started again at `next_start`


class GatewayProcess:
    """The one gateway process and its restarts."""

    def __init__(self, runtime_dir: Path, endpoint: str, children: Children) -> None:
        self.runtime_dir = runtime_dir
        self.endpoint = endpoint
        self.children = children
        self.child = ChildRecord(ChildKind.GATEWAY, "oip")
        self.state = GatewayState.OFF
        self.oip: OipConfig | None = None

    def exited(self, now: float) -> tuple[str, float] | None:
        """How an ended gateway ended (as the reaper found it) and how long it ran, else None."""
        child = self.child
        if child.exit_code is None or child.process is None:
            return None
        how = describe_exit(child.exit_code)
        log.warning("gateway_exited", pid=child.pid, exit=how)
        return how, now - child.started_at

    def tick(self, now: float, config: Config) -> str | None:
        """Start one when config wants it and its back-off has passed; why it did not start, if it failed to."""
        self.oip = config.oip
        if self.oip is None or self.child.process is not None or now < self.child.next_start:
            return None
        return self.start(now, config)

    def start(self, now: float, config: Config) -> str | None:
        """Spawn the gateway with its launch (addresses, limits, our pid); on OSError, why it did not start."""
        oip = config.oip
        if oip is None:
            return None
        launch = {
            "endpoint": self.endpoint,
            "runtime_dir": str(self.runtime_dir),
            "http": oip.http,
            "grpc": oip.grpc,
            "max_frame_bytes": config.max_frame_bytes,
            # A request's whole body: JSON text of a tensor at the frame limit (~3 characters a byte in binary), and
            # room for the header; within what grpcio takes as a message cap.
            "max_body_bytes": min(config.max_frame_bytes * 3 + 2**20, _MAX_BODY_BYTES),
            "supervisor_pid": os.getpid(),
        }
        try:
            # A fresh interpreter, not a fork of the warm template: the gateway never imports torch.
            process = HOME.exec_fresh([sys.executable, "-P", "-m", "infervisor.gateway", json.dumps(launch)], "gateway")
        except OSError as exc:
            log.error("gateway_spawn_failed", error=str(exc))
            return f"could not start: {exc}"
        self.children.adopt(self.child, process, None, ("gateway", (), now), None)  # no link: a broker client
        self.state = GatewayState.RUNNING
        log.info("gateway_started", pid=process.pid, http=oip.http, grpc=oip.grpc)
        return None

    def ended(self, now: float, how: str, restart_in: float, ends_in_row: int) -> None:
        """Counted, and `restart_in` waited before the next start (the exit decision's back-off for this end)."""
        self.child.ended(how, restart_in, ends_in_row, now)
        self.state = GatewayState.BACKOFF

    def stop(self) -> None:
        """SIGTERM, a short grace to close the listeners, then SIGKILL; reaped before returning."""
        process = self.child.process
        self.state = GatewayState.OFF
        if process is None:
            return
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass  # SIGKILL next
        self.child.close()

    def status(self) -> dict[str, Any] | None:
        """Status `endpoints.oip`: None without `oip`; else where it listens and how the process stands."""
        if self.oip is None:
            return None
        return {**dataclasses.asdict(self.oip), "state": self.state.value, **self.child.report()}
