"""`python -P -m infervisor.gateway LAUNCH_JSON`: the OIP gateway the daemon starts when config has `oip`.

One asyncio loop serves both front ends (aiohttp, grpcio's asyncio server) and reads the broker's replies;
none of it shares the broker's loop, and nothing here imports torch or the daemon.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.asyncio
from aiohttp import web

from infervisor.gateway.broker_link import BrokerLink
from infervisor.gateway.catalog import Catalog
from infervisor.gateway.grpc_service import make_server
from infervisor.gateway.http_app import make_app
from infervisor.gateway.serving import Gateway

_PR_SET_PDEATHSIG = 1
#: Exit code when the daemon that started us is already gone.
EXIT_PARENT_GONE = 4


@dataclass(frozen=True)
class Launch:
    """What the daemon tells its gateway (supervisor/workers/gateway_process.py writes it)."""

    endpoint: str
    runtime_dir: str
    http: str | None
    grpc: str | None
    max_frame_bytes: int
    max_body_bytes: int
    supervisor_pid: int


def die_with_parent(supervisor_pid: int) -> bool:
    """Ask the kernel for SIGKILL when the daemon dies (even by kill -9); False when it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == supervisor_pid


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(launch: Launch) -> None:
    """Start the front ends configured, then serve until SIGTERM."""
    context = zmq.asyncio.Context()
    link = BrokerLink(launch.endpoint, context)
    catalog = Catalog(Path(launch.runtime_dir))
    gateway = Gateway(link, catalog, launch.max_frame_bytes)
    tasks = [asyncio.create_task(link.read_replies()), asyncio.create_task(catalog.keep_fresh())]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = None
    grpc_server = None
    try:
        if launch.http is not None:
            runner = web.AppRunner(make_app(gateway, launch.max_body_bytes), access_log=None)
            await runner.setup()
            host, port = _host_port(launch.http)
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        if launch.grpc is not None:
            grpc_server = make_server(gateway, launch.grpc, launch.max_body_bytes)
            await grpc_server.start()
        print(json.dumps({"event": "gateway_serving", "http": launch.http, "grpc": launch.grpc}), flush=True)
        await stop.wait()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(1.0)
        if runner is not None:
            await runner.cleanup()
        for task in tasks:
            task.cancel()
        link.close()
        context.term()


def main(argv: list[str]) -> int:
    """Parse the launch, tie our life to the daemon's, serve."""
    raw: dict[str, Any] = json.loads(argv[1])
    launch = Launch(**raw)
    if not die_with_parent(launch.supervisor_pid):
        return EXIT_PARENT_GONE
    asyncio.run(serve(launch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
