"""The sd_notify datagram protocol, spoken directly so no libsystemd is needed."""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    """Sends state lines to $NOTIFY_SOCKET; silently does nothing when not run by systemd."""

    def __init__(self, address: str | None = None) -> None:
        raw = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace.
        self.address = "\0" + raw[1:] if raw.startswith("@") else raw
        self.socket: socket.socket | None = None
        if self.address:
            self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        """True when a notify socket was given."""
        return self.socket is not None

    def notify(self, *lines: str) -> None:
        """Send `KEY=value` lines as one datagram; a lost datagram must never stop serving."""
        if self.socket is None:
            return
        try:
            self.socket.sendto("\n".join(lines).encode(), self.address)
        except OSError:
            pass

    def ready(self, status: str) -> None:
        """READY=1 plus a status line."""
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def reloading(self) -> None:
        """RELOADING=1 with the MONOTONIC_USEC that Type=notify-reload requires."""
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        """STOPPING=1."""
        self.notify("STOPPING=1", "STATUS=stopping")

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when no watchdog is armed."""
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        if not self.enabled or not usec.isdigit() or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 2_000_000

    def status(self, text: str) -> None:
        """A free-form STATUS= line."""
        self.notify(f"STATUS={text}")
