"""The daemon's parts, built and wired once: who talks to whom is decided here, and the arbiter only runs the loop.

Worker links deliver to the worker inbox, which hands replies to the broker, lifecycle messages to the
pool and canary answers to the responses; the broker routes to the pool's members; the reloader and the
fallback start rollouts the pool carries out; the monitors come from their table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from infervisor.supervisor.core.fallback_control import FallbackControl
from infervisor.supervisor.core.readiness import Readiness
from infervisor.supervisor.core.reloader import ConfigReloader
from infervisor.supervisor.core.responses import Responses
from infervisor.supervisor.host.affinity import SupervisorAffinity
from infervisor.supervisor.host.cpu_latency import CpuLatencyHold
from infervisor.supervisor.host.event_loop import EventLoop
from infervisor.supervisor.host.file_watch import FileWatcher
from infervisor.supervisor.host.memory_release import MemoryRelease
from infervisor.supervisor.host.planner import Assignment, WorkerDemand, plan_cores
from infervisor.supervisor.host.sd_notify import Notifier
from infervisor.supervisor.host.topology import read_topology
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.monitors.registry import Monitors, build_monitors
from infervisor.supervisor.observe.exposition import Metrics
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.routing.endpoints import ClientEndpoints
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.routing.replies import client_replies
from infervisor.supervisor.routing.streams import Streams
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.child_home import HOME, ChildHome
from infervisor.supervisor.workers.launcher import Launcher
from infervisor.supervisor.workers.slot import WorkerSlot
from infervisor.supervisor.workers.worker_inbox import WorkerInbox
from infervisor.supervisor.workers.worker_links import WorkerLinks

Plan = dict[str, list[Assignment]]


@dataclass(frozen=True)
class Parts:
    """Everything the loop drives, wired to each other."""

    runtime_dir: Path
    started_at: float
    serving: ServingConfig
    affinity: SupervisorAffinity
    context: zmq.Context[Any]
    loop: EventLoop
    anomalies: Anomalies
    endpoints: ClientEndpoints
    links: WorkerLinks
    broker: Broker
    pool: WorkerPool
    monitors: Monitors
    #: Models moved down their chain (`infervisor fallback`, repeated canary mismatches).
    fallback: FallbackControl
    responses: Responses
    inbox: WorkerInbox
    readiness: Readiness
    cpu_latency: CpuLatencyHold
    watcher: FileWatcher
    reloader: ConfigReloader
    #: Published each monitor turn; served over HTTP only with metrics_listen, and by `infervisor metrics`.
    metrics: Metrics
    #: Large client frames are given back to the box once freed (host/memory_release.py).
    memory: MemoryRelease
    #: Where every child process is started (the warm template) and what the supervisor adopts is reaped.
    home: ChildHome


def core_planner(sysfs_root: Path, affinity: SupervisorAffinity) -> Callable[[Config], Plan]:
    """Core assignments per model, from the topology and the cpus this process was given at start."""

    def plan(config: Config) -> Plan:
        demands = [
            WorkerDemand(m.name, m.workers, m.cores_per_worker, m.use_smt, m.threads) for m in config.models.values()
        ]
        # The cpus we were given at start, not our own mask now: pinning the supervisor narrows that.
        assignments = plan_cores(read_topology(sysfs_root), affinity.allowed, demands, config.oversubscribe)
        planned: Plan = {name: [] for name in config.models}
        for assignment in assignments:
            planned[assignment.model].append(assignment)
        return planned

    return plan


def wire_audit(broker: Broker, pool: WorkerPool, monitors: Monitors) -> None:
    """Wire each successful answer to the samplers (the live audit's, the shadow's, the input recorder's), and the
    audit runner's verdicts to the audit monitor, which only judges them."""
    audit, shadows, recorder = pool.audits.offer, pool.builds.offer, pool.builds.recorder.offer

    def tap(slot: WorkerSlot, request: PendingRequest, frames: list[Any]) -> None:
        """Each successful answer: the live audit's, the shadow's and the input recorder's sampler (each never
        raises)."""
        audit(slot, request, frames)
        shadows(slot, request, frames)
        recorder(slot, request, frames)

    broker.audit_tap = tap
    monitors.audit.read_from(pool.audits)


def assemble(
    config: Config,
    config_path: Path,
    runtime_dir: Path,
    sysfs_root: Path,
    launcher: Launcher,
    source_dir: Path | None = None,
) -> Parts:
    """Build the daemon's parts for `config` and wire them; nothing runs until the arbiter's loop starts."""
    started_at = time.time()
    serving = ServingConfig(config)
    affinity = SupervisorAffinity(frozenset(os.sched_getaffinity(0)))
    plan = core_planner(sysfs_root, affinity)
    memory = MemoryRelease()
    memory.map_large_blocks()  # before libzmq's I/O thread receives anything
    context: zmq.Context[Any] = zmq.Context(1)
    loop = EventLoop()
    anomalies = Anomalies()
    endpoints = ClientEndpoints(context, config, runtime_dir)
    links = WorkerLinks(loop, anomalies)
    replies = client_replies(endpoints.sockets, serving, anomalies)
    # Every accepted request's final reply passes the streams' stage on its way to the replies (one way).
    streams = Streams(replies.queues, replies.finish)
    broker = Broker(endpoints, loop, links, serving, anomalies, replies, streams)
    # One reaper for every child of the daemon, the strangers it adopts as a subreaper included.
    pool = WorkerPool(serving, plan(config), links, broker, launcher, HOME)
    monitors = build_monitors()
    wire_audit(broker, pool, monitors)
    fallback = FallbackControl(serving, pool)
    responses = Responses(serving, pool, broker, links, fallback, monitors.canaries)
    # Each worker message goes straight to its owner; a link that lost its framing, to the pool.
    inbox = WorkerInbox(anomalies, broker, pool, responses.judge_canary)
    links.deliver_to(inbox.deliver, pool.link_broken)
    notifier = Notifier()
    readiness = Readiness(notifier, started_at)
    watcher = FileWatcher(loop.wake)
    reloader = ConfigReloader(
        config_path,
        serving,
        pool,
        plan,
        watcher,
        notifier,
        started_at,
        fallback.fallbacks,
        readiness.current_line,
        source_dir,
    )
    return Parts(
        runtime_dir=runtime_dir,
        started_at=started_at,
        serving=serving,
        affinity=affinity,
        context=context,
        loop=loop,
        anomalies=anomalies,
        endpoints=endpoints,
        links=links,
        broker=broker,
        pool=pool,
        monitors=monitors,
        fallback=fallback,
        responses=responses,
        inbox=inbox,
        readiness=readiness,
        cpu_latency=CpuLatencyHold(),
        watcher=watcher,
        reloader=reloader,
        metrics=Metrics(),
        memory=memory,
        home=HOME,
    )
