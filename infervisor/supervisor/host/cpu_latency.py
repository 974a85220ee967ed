"""A CPU latency QoS request held while the daemon runs, so an idle CPU wakes fast when a request arrives.

A sequential client leaves every CPU idle between requests, and an idle CPU sleeps. Leaving a sleep
state is the largest cost in a round trip on a box whose idle state is slow to leave: on this nested
VM (cpuidle haltpoll with halt polling off) a socketpair round trip after 28 ms idle takes 219 µs
with the CPUs halting and 51 µs with a 0 µs request held (`bench/link.py --gap-us 28000`). On bare
metal the same request keeps deep C-states off. It costs power and heat: a CPU that may not sleep
polls instead, so it is opt-in (`cpu_latency_us`), and released while the thermal monitor reports
throttling.

The kernel keeps the request only while the file descriptor is open, so a daemon that dies, even by
SIGKILL, leaves nothing behind.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import structlog

log = structlog.get_logger("supervisor")

#: The kernel's CPU latency QoS interface (Documentation/power/pm_qos_interface.rst).
DEVICE = Path("/dev/cpu_dma_latency")


def current_limit(device: Path = DEVICE) -> int:
    """The limit the kernel enforces now, in µs: the lowest request any process holds."""
    fd = os.open(device, os.O_RDONLY)
    try:
        (value,) = struct.unpack("=i", os.read(fd, 4))
    finally:
        os.close(fd)
    return int(value)


class CpuLatencyHold:
    """Holds the configured request; reconcile moves it toward what the daemon wants now."""

    def __init__(self, device: Path = DEVICE) -> None:
        self.device = device
        self._fd: int | None = None
        #: The value the kernel has from us (µs), None when we hold nothing.
        self.held: int | None = None
        #: Let go because the box throttles; taken again when it stops.
        self.paused = False
        #: A value the kernel refused, not retried until the configured value changes (a warning per change).
        self.refused: int | None = None
        self.error: str | None = None

    def reconcile(self, configured: int | None, throttled: bool) -> None:
        """Hold the configured µs (None: nothing), except while `throttled`: polling idle would only add heat."""
        if configured is None or configured != self.refused:
            self.refused, self.error = None, None
        self.paused = throttled and configured is not None
        if configured is None or throttled:
            self.release("thermal throttling" if throttled else "config")
            return
        if configured in (self.held, self.refused):
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
            # Rewriting the open descriptor updates our request in place; a second open would add another.
            os.write(self._fd, struct.pack("=i", configured))
        except OSError as exc:  # not root, a hidden /dev (PrivateDevices=), or no such interface
            self.release("refused")
            self.refused, self.error = configured, f"{self.device}: {exc.strerror or exc}"
            log.warning("cpu_latency_refused", wanted_us=configured, error=self.error)
            return
        self.held = configured
        log.info("cpu_latency_held", us=configured, reason="config")

    def release(self, reason: str) -> None:
        """Drop the request (closing the descriptor is what withdraws it): the CPUs may sleep deep again."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.held is not None:
            log.info("cpu_latency_released", us=self.held, reason=reason)
        self.held = None

    def status(self, configured: int | None) -> dict[str, int | str | bool | None]:
        """The status document's view: what the config asks, what the kernel has from us, and why not."""
        return {"wanted_us": configured, "held_us": self.held, "paused": self.paused, "error": self.error}
