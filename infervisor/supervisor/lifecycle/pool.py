"""The worker pool: every slot's lifecycle, reconciled toward the configured shape on each `tick`.

The pool and the parts it holds alone create, spawn, kill, retire and move slots, and call slot
transitions. Its roster (infervisor/supervisor/lifecycle/roster.py) holds each model's members (the slots the
broker routes to) and the slots outside them (successors warming up, old workers draining away); its
rollout works the rolling-restart queue through its steps (rollout_steps.py); its stop sequence
(stopping.py) stops everything in order; its exit reaper (exits.py) judges each exit by
lifecycle/exit_decision.py and applies the verdict, whose one order about the dead worker's requests the
broker carries out; its watchdog (watchdog.py) kills the stuck, reading a worker's load through the broker's
read-only view (busy, hung, a batch running), and sends heartbeats. The worker inbox hands it what workers
say of their lifecycle (READY, PROGRESS, LOAD_ERROR, drained), the worker links what broke. The monitors'
findings reach it through core/responses.py.
"""

from __future__ import annotations

import collections
import time

import structlog

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.lifecycle.audit_runner import AuditRunner
from infervisor.supervisor.lifecycle.background_build import BackgroundBuilds
from infervisor.supervisor.lifecycle.exit_decision import BACKOFF_MAX_S, same_error
from infervisor.supervisor.lifecycle.exits import ExitReaper
from infervisor.supervisor.lifecycle.rollout import Replacement, Rollout
from infervisor.supervisor.lifecycle.rollout_steps import RolloutSteps
from infervisor.supervisor.lifecycle.roster import Roster
from infervisor.supervisor.lifecycle.stopping import STOP_KILL_AFTER_S, StopSequence
from infervisor.supervisor.lifecycle.watchdog import PROFILE_START_GRACE_S, Watchdog
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.config_diff import ConfigDiff, builds_differ, worker_keys_changed
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.child_home import ChildHome
from infervisor.supervisor.workers.child_links import ChildLinks
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.launcher import Launcher, launch_worker
from infervisor.supervisor.workers.reaper import Reaper
from infervisor.supervisor.workers.slot import RestartReason, SlotState, WorkerSlot
from infervisor.supervisor.workers.worker_links import WorkerLinks

log = structlog.get_logger("supervisor")

__all__ = ["PROFILE_START_GRACE_S", "WorkerPool", "same_error"]


class WorkerPool:
    """Owns the worker slots of every model and drives their state machines."""

    def __init__(
        self,
        serving: ServingConfig,
        plan: dict[str, list[Assignment]],
        links: WorkerLinks,
        broker: Broker,
        launcher: Launcher = launch_worker,
        home: ChildHome | None = None,
    ) -> None:
        self.serving = serving
        self.links = links
        self.broker = broker
        self.launcher = launcher
        models = serving.current.models
        self.roster = Roster(
            serving, {name: [WorkerSlot(models[name], a) for a in assignments] for name, assignments in plan.items()}
        )
        #: Worker processes replaced, per model and why: exits not asked for (here) and rollout steps (the rollout).
        self.restarts: collections.Counter[tuple[str, RestartReason]] = collections.Counter()
        self.rollout = Rollout(self.restarts)
        self.steps = RolloutSteps(self.roster, serving, self.rollout, links, broker, self.spawn, self.retire)
        self.stop = StopSequence(self.roster, serving, self.rollout, links, broker)
        #: Notices every child's end, of every kind, once per tick (workers/reaper.py; with the daemon's `home`, the
        #: strangers it adopted as a subreaper too); reads the builders', audits' and shadows' links on the loop.
        self.reaper = Reaper(home)
        self.children = Children(self.reaper, ChildLinks(links.loop, links.anomalies))
        #: Worker exits judged (exits.py); its `recent_exits` tell a new worker how the model's last ones ended.
        self.exits = ExitReaper(self.roster, serving, links, broker, self.restarts)
        #: Kills the stuck and sends heartbeats (watchdog.py).
        self.watchdog = Watchdog(self.roster, serving, links, broker)
        #: Each model's background build; its workers serve first until it is done (background_build.py).
        self.builds = BackgroundBuilds(
            lambda: serving.current, self.roster.members_of, self.switch_to_pick, self.children
        )
        #: Each model's live audit: its sampler and its audit process (audit_runner.py); the audit monitor judges.
        self.audits = AuditRunner(lambda: serving.current, self.roster.members_of, self.children)
        broker.route_to(self.roster.members_of)

    # ---- the reconcile step ------------------------------------------------------------------

    def start(self) -> None:
        """Spawn every member."""
        for slot in self.roster.all_slots():
            self.spawn(slot)

    def tick(self, now: float) -> None:
        """One reconcile step: reap every child's exit, kill the stuck, heartbeat, then stop or roll out, manage, build
        and audit (the builders', audits' and gateway's ends reaped here are judged at their owners' turns)."""
        self.reaper.reap(now)
        self.watchdog.murder(now)
        self.watchdog.heartbeat(now)
        if self.stop.stopping:
            self.builds.stop_all("the daemon stops")
            self.audits.stop_all()
            self.stop.advance(now)
            return
        self.rollout.advance(self.steps)
        self.settle_targets()
        self.manage(now)
        self.builds.tick(now, self.served_profiles)
        self.audits.tick(now)

    def spawn(self, slot: WorkerSlot) -> None:
        """Start the slot's process and listen to it; a failed fork/exec is retried later, not fatal."""
        self.links.detach(slot)
        config = self.serving.current
        try:
            launched = self.launcher(
                slot.model,
                slot.assignment,
                config,
                self.exits.recent_exits.get(slot.model.name, ()),
                ready_only=self.builds.serves_first(slot.model),
            )
        except OSError as exc:  # EAGAIN (pid limit), ENOMEM, EMFILE: the box is short of something
            log.error("spawn_failed", slot=slot.name, error=str(exc), retry_in_s=BACKOFF_MAX_S)
            if slot.state is not SlotState.BACKOFF:
                slot.transition(SlotState.BACKOFF, f"spawn failed: {exc}")
            slot.respawn_at = time.monotonic() + BACKOFF_MAX_S
            return
        slot.adopt_process(launched, config.heartbeat_interval_ms / 1000.0, config.heartbeat_liveness, time.monotonic())
        self.reaper.watch(launched.process, lambda code, now: self.exits.reaped(slot, launched.process, code, now))
        slot.transition(SlotState.STARTING, f"spawned pid {launched.process.pid} on cpus {list(slot.assignment.cpus)}")
        self.links.attach(slot)

    def manage(self, now: float) -> None:
        """Reconcile toward the desired pools: respawn members whose back-off has elapsed, forget retired slots."""
        for slot in self.roster.member_slots():
            if slot.state is SlotState.STOPPED or (slot.state is SlotState.BACKOFF and now >= slot.respawn_at):
                self.spawn(slot)
        self.roster.forget_stopped(keep=self.rollout.successor)

    def settle_targets(self) -> None:
        """A model whose every member is built from its rollout target serves with that config from now on."""
        for name in self.serving.rolling():
            target = self.serving.target(name)
            members = self.roster.members.get(name)
            if members is None:
                self.serving.drop_rollout(name)
            elif target is not None and not self.rollout.has_work_for(name):
                if not any(builds_differ(s.model, target) for s in members):
                    self.serving.finish_rollout(name)
                    log.info("model_config_applied", model=name)

    def switch_to_pick(self, model: str, reason: str) -> None:
        """The model's background build is done: its workers move to the pick by rolling replacement."""
        self.restart(model, reason, RestartReason.OPTIMIZED)

    def served_profiles(self, model: str) -> list[str] | None:
        """The profile each member of `model` serves, when every member serves and no rollout of it is under way."""
        members = self.roster.members_of(model)
        if not members or self.rollout.has_work_for(model):
            return None
        if any(slot.state is not SlotState.SERVING for slot in members):
            return None
        return [slot.proc.profile or "" for slot in members]

    # ---- what the workers said -----------------------------------------------------------------

    def worker_ready(self, slot: WorkerSlot, ready: wm.Ready) -> None:
        """A warm worker: it serves from now on."""
        if slot.state is not SlotState.STARTING:
            return
        now = time.monotonic()
        slot.proc.ready_ms = (now - slot.proc.spawned_at) * 1000.0
        slot.proc.ready_at = now
        slot.proc.expected_ms = ready.warmup_ms / max(1, slot.model.warmup_iterations)
        slot.proc.threads_seen = ready.threads
        slot.proc.profile, slot.proc.profile_notes = ready.profile, ready.profile_notes
        slot.proc.build_notes = ready.build_notes
        slot.notes.last_load_error = ""
        self.roster.has_served.add(slot.model.name)
        slot.transition(
            SlotState.SERVING,
            f"ready in {slot.proc.ready_ms:.0f} ms (load {ready.load_ms:.0f} ms, warm-up {ready.warmup_ms:.0f} ms, "
            f"profile {ready.profile})",
        )

    def worker_progress(self, slot: WorkerSlot, progress: wm.Progress, now: float | None = None) -> None:
        """A starting worker entered a phase: its clock and limits follow it, and the log says so (one event each)."""
        if slot.state is not SlotState.STARTING:
            return
        now = time.monotonic() if now is None else now
        ended = slot.proc.start.enter(progress, now)
        if ended is None:
            log.warning("worker_phase_unknown", slot=slot.name, phase=progress.phase[:64])
            return
        previous, took = ended
        clock = slot.proc.start
        log.info(
            "worker_phase",
            slot=slot.name,
            pid=slot.pid,
            phase=clock.phase.value,
            profile=clock.profile or None,
            index=clock.index or None,
            count=clock.count or None,
            elapsed_s=round(now - clock.spawned_at, 1),
            worker_elapsed_s=round(progress.elapsed_ms / 1000.0, 1),
            previous=previous.value,
            previous_s=round(took, 1),
            detail=clock.detail[:300] or None,
        )

    def worker_load_error(self, slot: WorkerSlot, error: wm.LoadError) -> None:
        """A starting worker says why its model cannot load; its exit, reaped next, carries that text to status."""
        slot.proc.load_error = error.error

    def track_descendants(self) -> None:
        """Walk each live worker's process tree, so what a crashing worker leaves running is killed at its reap."""
        for slot in self.roster.all_slots():
            slot.track_descendants()

    def link_broken(self, slot: WorkerSlot, reason: str) -> None:
        """A worker that cannot be written to or sent garbage is replaced: kill it, reaping does the rest."""
        slot.kill(reason, RestartReason.LINK_BROKEN)

    def worker_drained(self, slot: WorkerSlot) -> None:
        """A draining worker holds nothing any more: it may go."""
        self.links.send_control(slot, wm.Drain())

    # ---- restarts and reloads ----------------------------------------------------------------

    def retire(self, slot: WorkerSlot, reason: str) -> None:
        """Take a worker out of service gently: drain a serving one, stop a starting one, forget a dead one."""
        if slot not in self.roster.extra:
            self.roster.extra.append(slot)
        if slot.state is SlotState.SERVING:
            slot.transition(SlotState.DRAINING, reason)
            slot.proc.kill_at = time.monotonic() + self.serving.current.shutdown_grace_s + STOP_KILL_AFTER_S
            if not self.broker.load_of(slot).size:
                self.links.send_control(slot, wm.Drain())
        elif slot.state is SlotState.STARTING:
            slot.transition(SlotState.STOPPING, reason)
            slot.kill(reason)
        elif slot.state in (SlotState.BACKOFF, SlotState.FAILED):
            slot.transition(SlotState.STOPPED, reason)

    def restart(
        self,
        model: str | None,
        reason: str,
        cause: RestartReason = RestartReason.OPERATOR,
        forget_overruns: bool = False,
    ) -> int:
        """Queue a rolling restart of one model's workers (or all); returns how many were queued.

        `forget_overruns`: the new workers try again profiles whose builds overran the compile limit.
        """
        queued = 0
        for name, slots in self.roster.members.items():
            if model is None or name == model:
                for ended in self.exits.recent_exits.get(name, ()) if forget_overruns else ():
                    ended["compile_overrun"] = None
                for slot in slots:
                    self.rollout.enqueue(Replacement(slot, slot.model, slot.assignment, reason, cause))
                    queued += 1
        log.info("restart_requested", model=model or "*", workers=queued, reason=reason)
        return queued

    def recycle(self, slot: WorkerSlot, reason: str) -> None:
        """Replace one worker for a monitor, rolling, unless it is already being replaced."""
        if not self.rollout.involves(slot):
            self.rollout.enqueue(Replacement(slot, slot.model, slot.assignment, reason, RestartReason.MONITOR_RECYCLE))

    def adopt(self, new: Config, plan: dict[str, list[Assignment]], diff: ConfigDiff) -> None:
        """Reshape the pools for a config the arbiter now serves: new, removed and scaled models at once,
        rebuilt workers by rolling replacement. Live keys need nothing here: every part reads them from
        the serving config."""
        for name in diff.removed:
            self.rollout.drop_model(name, "model removed from config")
            self.rollout.failed.pop(name, None)  # a model added again later under the name starts with no error
            for slot in self.roster.members.pop(name):
                self.retire(slot, "model removed from config")
            self.broker.remove_model(name)
        for name, wanted in plan.items():
            model = self.serving.desired(name) or new.models[name]
            pool = self.roster.members.setdefault(name, [])
            for slot in pool[len(wanted) :]:
                self.retire(slot, f"scaled down to {len(wanted)} workers")
            del pool[len(wanted) :]
            for index, assignment in enumerate(wanted):
                if index >= len(pool):
                    slot = WorkerSlot(model, assignment)
                    pool.append(slot)
                    self.spawn(slot)
                    continue
                slot = pool[index]
                moved = slot.assignment.cpus != assignment.cpus or slot.assignment.threads != assignment.threads
                # A worker already built from this config (an earlier step of the same rollout) stays.
                stale = worker_keys_changed(diff, name) or builds_differ(slot.model, model)
                if name in diff.rolling and stale:
                    self.builds.restart(name, "config: how its workers are built changed")
                # One already queued or being replaced gets the newest config anyway: a step reads it when it starts.
                if (moved or (name in diff.rolling and stale)) and not self.rollout.involves(slot):
                    why = ", ".join(diff.rolling.get(name, [])) or "cores re-planned"
                    self.rollout.enqueue(Replacement(slot, model, assignment, f"config: {why}", RestartReason.CONFIG))
        self.broker.sync_queues()
        for name in self.roster.members:
            self.broker.dispatcher.dispatch(name)
