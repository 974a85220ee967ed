"""Starting a worker process (serving, building or auditing) linked by a socketpair, through the daemon's one home
for children (child_home.py: a fork of the warm template that has run no torch op, else a fresh interpreter)."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from infervisor.protocol.constants import MAX_HEADER_BYTES
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.child_home import CHILD_ENV_DEFAULTS, HOME, ChildHome, ChildProcess

_generations = itertools.count(1)

#: Send buffer asked for on each end of a worker link (Linux doubles it, up to 2 x net.core.wmem_max).
_LINK_BUFFER_BYTES = 4 * 2**20

#: The module a worker process runs; the live audit's process runs AUDIT_ENTRY instead (same launch spec and link).
WORKER_ENTRY = "infervisor.worker"
AUDIT_ENTRY = "infervisor.worker.audit"

#: Read by the OpenMP/MKL runtimes when torch loads; a child forked from the template loaded torch before them, and
#: sets its pools again with torch.set_num_threads before any op (worker/serve.py, worker/audit_loop.py).
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


#: What the pool needs of a worker process (a subprocess.Popen, or a child forked from the template).
WorkerProcess = ChildProcess


@dataclass
class Launched:
    """A started worker: its process, the supervisor's end of its link, and its id."""

    process: WorkerProcess
    link: Link | None
    worker_id: str


#: How one worker ended, as the next worker of its model is told (LaunchSpec.recent_exits).
ExitRecord = dict[str, Any]


class Launcher(Protocol):
    """Starts one worker of a model on an assignment under a config (replaced in tests that need no processes).

    `ready_only`: the worker serves first, from what needs no build (the background builder builds the rest).
    """

    def __call__(
        self,
        model: ModelConfig,
        assignment: Assignment,
        config: Config,
        recent_exits: Sequence[ExitRecord] = (),
        *,
        ready_only: bool = False,
    ) -> Launched: ...


def worker_environment(threads: int, cache_dir: Path) -> dict[str, str]:
    """The supervisor's environment with thread pools sized to the worker's core set, inductor's cache in ours."""
    env = dict(os.environ)
    for name in THREAD_ENV_VARS:
        env[name] = str(threads)
    # torch.compile's own on-disk caches then survive reboots and are shared with our packages' lifetime.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    # A library's tqdm progress bar (a model's own code, a hub download) would land between the JSON log lines.
    for name, value in CHILD_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    return env


def served_batches(model: ModelConfig) -> list[int]:
    """The batch sizes the broker may join this model's requests into: its preferred ones and its maximum."""
    if model.batching is None:
        return []
    return sorted({*model.batching.preferred_batch_sizes, model.batching.max_batch_size})


def launch_spec(
    model: ModelConfig,
    assignment: Assignment,
    config: Config,
    worker_id: str,
    link_fd: int,
    recent_exits: Sequence[ExitRecord] = (),
    build_only: bool = False,
    ready_only: bool = False,
    background: bool = False,
) -> LaunchSpec:
    """Everything the worker needs before it imports torch, from the model's config and its cores."""
    return LaunchSpec(
        worker_id=worker_id,
        model=model.name,
        link_fd=link_fd,
        source=model.source,
        inputs=model.inputs,
        output_names=model.outputs,
        cpus=assignment.cpus,
        threads=assignment.threads,
        warmup_iterations=model.warmup_iterations,
        heartbeat_interval_ms=config.heartbeat_interval_ms,
        heartbeat_liveness=config.heartbeat_liveness,
        max_frame_bytes=config.max_frame_bytes,
        max_memory_mb=model.max_memory_mb,
        profiles=model.profiles,
        pick=model.pick,
        tolerance=model.tolerance,
        typical_shape=model.typical_shape,
        channels_last=model.channels_last,
        cache_dir=str(resolve_cache_dir(config.cache_dir)),
        calibration=model.calibration,
        validation=model.validation,
        recent_exits=list(recent_exits),
        served_batches=served_batches(model),
        state=model.state,
        sequence_steps=model.sequence_steps,
        recorded_inputs_mb=model.record_inputs_mb if model.record_inputs else 0,
        supervisor_pid=os.getpid(),
        client_gid=config.socket_group.gid if config.socket_group is not None else None,
        compile_timeout_s=config.compile_timeout_s,
        build_only=build_only,
        ready_only=ready_only,
        background=background,
        shadow=model.shadow == "on" and model.build == "background",
    )


def launch_worker(
    model: ModelConfig,
    assignment: Assignment,
    config: Config,
    recent_exits: Sequence[ExitRecord] = (),
    build_only: bool = False,
    output: IO[bytes] | None = None,
    *,
    ready_only: bool = False,
    background: bool = False,
    entry: str = WORKER_ENTRY,
    home: ChildHome = HOME,
) -> Launched:
    """Start a worker process for `model` on `assignment`; OSError when the box cannot start one now.

    `build_only` (infervisor build): the worker fills the cache with its packaged profiles and exits.
    `output`: where its stdout and stderr go (default: the supervisor's, where the daemon logs).
    `ready_only`: it serves first, from what needs no build. `background`: the background builder (with
    `build_only`), at the lowest CPU priority. `entry`: the module the process runs (AUDIT_ENTRY: the live audit).
    `home`: where it is started (forked from the daemon's warm template when it has one, else exec'd).
    """
    role = entry.rpartition(".")[2] if entry != WORKER_ENTRY else "build" if background else assignment.slot
    worker_id = f"{model.name}.{role}.{next(_generations)}"
    cache_dir = resolve_cache_dir(config.cache_dir)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for end in (ours, theirs):
            # Room for a whole image in one write: with the default 208 KB a 600 KB tensor goes over
            # in three turns of write, wake the reader, wait for room. The kernel caps it at wmem_max.
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _LINK_BUFFER_BYTES)
        spec = launch_spec(
            model, assignment, config, worker_id, theirs.fileno(), recent_exits, build_only, ready_only, background
        )
        process = home.start(
            entry,
            spec.to_json(),
            worker_environment(assignment.threads, cache_dir),
            theirs.fileno(),
            output,
            worker_id,
        )
    except BaseException:  # nothing may keep our end open when no process got the other
        ours.close()
        raise
    finally:
        theirs.close()  # the child has its copy; ours would only hide the worker's EOF
    # Workers refuse to send an output frame over max_frame_bytes, so a longer one is a garbled stream.
    link = Link(ours, WORKER_LINK_FRAMES, max(config.max_frame_bytes, MAX_HEADER_BYTES))
    return Launched(process, link, worker_id)
