"""The Open Inference Protocol gateway as the daemon holds it: started, reaped, restarted with back-off, stopped.

How long it waits before its next start is lifecycle/exit_decision.py's (`decide_child_exit`), applied each
housekeeping turn by lifecycle/exits.py `keep_gateway` through `exited`, `tick` and `ended`.

The gateway (`python -P -m infervisor.gateway`, infervisor/gateway/) is a client of the broker on the ipc
endpoint, in its own process so HTTP and gRPC never share the broker's loop. It asks the kernel to kill it when
the daemon dies, so even a kill -9 of the daemon leaves no gateway behind.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from infervisor.supervisor.settings.config import Config, OipConfig
from infervisor.supervisor.workers.child_home import HOME
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

    def __init__(self, runtime_dir: Path, endpoint: str) -> None:
        self.runtime_dir = runtime_dir
        self.endpoint = endpoint
        self.process: subprocess.Popen[bytes] | None = None
        self.state = GatewayState.OFF
        self.oip: OipConfig | None = None
        self.started_at = 0.0
        self.next_start = 0.0
        self.failures_in_row = 0
        self.restarts = 0
        self.last_exit: str | None = None

    def exited(self, now: float) -> tuple[str, float] | None:
        """How an ended gateway ended and how long it ran (reaped and counted), else None."""
        if self.process is None or self.process.poll() is None:
            return None
        pid, code = self.process.pid, self.process.returncode
        self.process = None
        self.last_exit = describe_exit(code)
        log.warning("gateway_exited", pid=pid, exit=self.last_exit)
        self.restarts += 1
        return self.last_exit, now - self.started_at

    def tick(self, now: float, config: Config) -> str | None:
        """Start one when config wants it and its back-off has passed; why it did not start, if it failed to."""
        self.oip = config.oip
        if self.oip is None or self.process is not None or now < self.next_start:
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
            self.process = HOME.exec_fresh(
                [sys.executable, "-P", "-m", "infervisor.gateway", json.dumps(launch)], "gateway"
            )
        except OSError as exc:
            log.error("gateway_spawn_failed", error=str(exc))
            return f"could not start: {exc}"
        self.state, self.started_at = GatewayState.RUNNING, now
        log.info("gateway_started", pid=self.process.pid, http=oip.http, grpc=oip.grpc)
        return None

    def ended(self, now: float, restart_in: float, ends_in_row: int) -> None:
        """Wait `restart_in` before the next start (the exit decision's back-off for this end in a row)."""
        self.failures_in_row = ends_in_row
        self.state, self.next_start = GatewayState.BACKOFF, now + restart_in

    def stop(self) -> None:
        """SIGTERM, a short grace to close the listeners, then SIGKILL; reaped before returning."""
        process, self.process = self.process, None
        self.state = GatewayState.OFF
        if process is None:
            return
        process.terminate()
        try:
            process.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def status(self) -> dict[str, Any] | None:
        """Status `endpoints.oip`: None without `oip`; else where it listens and how the process stands."""
        if self.oip is None:
            return None
        return {
            **dataclasses.asdict(self.oip),
            "state": self.state.value,
            "pid": self.process.pid if self.process is not None else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "next_start_in_s": (
                round(max(0.0, self.next_start - time.monotonic()), 3) if self.state is GatewayState.BACKOFF else None
            ),
        }
