"""The worker's entry after pinning: open the link, run the start sequence (start.py), then the serving loop
(loop.py); nothing the model started outlives it."""

from __future__ import annotations

import os
import socket

import structlog
import torch

from infervisor.protocol.constants import MAX_HEADER_BYTES
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link
from infervisor.worker import reexec
from infervisor.worker.loop import WorkerLoop
from infervisor.worker.process_tree import become_subreaper, end_descendants
from infervisor.worker.progress import LinkProgress
from infervisor.worker.start import start_model


def serve(launch: LaunchSpec) -> int:
    """Load and warm the model (telling the supervisor each phase), announce READY, then run the serving loop."""
    structlog.contextvars.bind_contextvars(worker_id=launch.worker_id, model=launch.model)
    torch.set_num_threads(launch.threads)
    # Ours alone: a process this worker starts (a compiler) must not hold the link open past the worker's exit.
    os.set_inheritable(launch.link_fd, False)
    # Open from the start, so the supervisor hears what a long start is doing (PROGRESS) before READY.
    link = Link(
        socket.socket(fileno=launch.link_fd),
        WORKER_LINK_FRAMES,
        max(launch.max_frame_bytes, MAX_HEADER_BYTES),
    )
    first = reexec.carried()
    progress = LinkProgress(link, launch.profiles, launch.heartbeat_interval_ms / 1000.0 * launch.heartbeat_liveness)
    become_subreaper()
    if first is not None:  # a restarted image: its start began in the image that built
        progress.started = first.started
    try:
        started = start_model(launch, link, progress)
        if isinstance(started, int):
            return started
        return WorkerLoop(launch, started.runner, link).run(started.ready)
    finally:
        # Nothing the model started outlives the worker (a recycle, a stop, a failed load).
        end_descendants()
        link.close()
