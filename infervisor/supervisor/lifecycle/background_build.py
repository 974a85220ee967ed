"""The background builder: a model's workers serve at once from what is ready, its chain is built behind them.

A worker of a model with `build: background` starts serving first (LaunchSpec.ready_only): a
verified cached package, else a profile that builds nothing (eager). Meanwhile one builder per
model, a worker process in build mode (the one `infervisor build` runs) at the lowest CPU priority
(SCHED_IDLE, else nice 19) with its own memory cap, builds, checks and times the chain exactly as
a worker would, fills the cache, remembers a fastest pick and says what a worker would serve now.
Its process then ends, so nothing of the build stays in any serving worker. If its pick is not
what the model serves, the model's workers move to it by the rolling replacement; workers spawned
from then on start normally (loading the pick from the cache).

Builders run one at a time (a box sharing its cores with serving is not asked to compile twice at
once), each once its model serves. A builder that dies of a signal while on a profile is started
again and told how its predecessor ended (as `infervisor build` does): a SIGKILL (the OOM killer,
kill -9, a reboot's stop) is retried once, a second one or any other native crash refuses that
profile with the reason (profiles/attempts.py), and the chain goes on. Those rules, and when a
build fails, are lifecycle/exit_decision.py's (`decide_build_exit`); `settle` applies them. Packages are installed
whole after their digest is stored (cache.py), so a killed build leaves nothing a worker loads.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import structlog

from infervisor.common import verdicts
from infervisor.common.profiles import PROFILES, TIMED_AT_NOTE
from infervisor.common.verdicts import SHADOW_PASSED_NOTE, lossy
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import OUTCOME_PHASES, StartPhase
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.lifecycle.build_gate import BuildGate
from infervisor.supervisor.lifecycle.exit_decision import BuildExitFacts, Then, decide_build_exit
from infervisor.supervisor.lifecycle.input_recorder import InputRecorder
from infervisor.supervisor.lifecycle.shadow import ShadowOutcome, ShadowRun, spec_key_in
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.child_record import ChildRecord
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.launcher import ExitRecord, Launched, launch_worker
from infervisor.supervisor.workers.retry_policy import ChildKind
from infervisor.supervisor.workers.slot import WorkerSlot, describe_exit

log = structlog.get_logger("supervisor")

#: How often the recorded refusals (common/verdicts.py) are read again for status.
_VERDICTS_EVERY_S = 2.0


class BuildState(enum.Enum):
    """Where a model's background build stands (status `models.<name>.build.state`)."""

    WAITING = "waiting"  # for its model to serve, or for another model's builder to finish
    BUILDING = "building"  # a builder process runs
    SHADOW = "shadow"  # its pick is lossy: it runs in shadow on live requests before the switch (shadow.py)
    DONE = "done"  # built, checked and timed: the pick serves or the switch to it is under way
    FAILED = "failed"  # the builder could not finish; the workers serve on what was ready (never a serving failure)


def needs_builder(model: ModelConfig) -> bool:
    """A model whose chain has something to build, time or shadow, built in the background."""
    if model.build != "background":
        return False
    chain = model.profiles
    return (
        any(not PROFILES[p].builds_nothing for p in chain)
        or (model.pick == "fastest" and len(chain) > 1)
        or (model.shadow == "on" and any(lossy(p) for p in chain))
    )


def builder_memory_mb(config: Config, model: ModelConfig) -> int:
    """The builder's data-segment cap: `builder_memory_mb`, else the model's `max_memory_mb`, else half the box's
    memory (a compile that wants more fails inside the builder, a refused profile, instead of waking the OOM
    killer among the serving workers)."""
    return config.builder_memory_mb or model.max_memory_mb or int(psutil.virtual_memory().total // 2**20 // 2)


@dataclass
class ModelBuild:
    """One model's background build: its process, where it is, and what each profile came to."""

    model: str
    state: BuildState = BuildState.WAITING
    started_at: float | None = None
    ended_at: float | None = None
    #: Its builder process now, its link, and the builders started for this build (each native crash costs one).
    child: ChildRecord = field(init=False)
    #: How each earlier builder of this build ended, as the next one is told (LaunchSpec.recent_exits).
    exits: list[ExitRecord] = field(default_factory=list)
    phase: str = ""
    profile: str = ""
    index: int = 0
    count: int = 0
    phase_at: float = 0.0
    #: profile -> (outcome, why), in the order they were decided.
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: What a worker would serve after this build (the builder's READY), "" until it said.
    picked: str = ""
    #: At which input size its fastest pick timed the candidates ("" when it timed none).
    timed_at: str = ""
    error: str = ""
    #: SIGKILLs per profile: the first is retried, the second refuses it.
    kills: dict[str, int] = field(default_factory=dict)
    #: The builder's READY notes (its pick's evidence: the spec key, a shadow it already passed).
    notes: list[str] = field(default_factory=list)
    #: Its lossy pick in shadow (state SHADOW), or the last shadow's outcome.
    shadow: ShadowRun | None = None
    #: Stops the running builder while requests are in flight (config build_yield); the last one's, once it ended.
    gate: BuildGate | None = None

    def __post_init__(self) -> None:
        self.child = ChildRecord(ChildKind.BUILDER, self.model)

    @property
    def running(self) -> bool:
        """A builder process is held (alive, or ended and not settled yet)."""
        return self.child.process is not None

    def report(self, now: float) -> dict[str, object]:
        """The status document's `build` object of the model."""
        elapsed = (self.ended_at or now) - self.started_at if self.started_at is not None else None
        report: dict[str, object] = {
            "state": self.state.value,
            "summary": self.line(now),
            "elapsed_s": round(elapsed, 1) if elapsed is not None else None,
            "attempts": self.child.starts,
            "pid": self.child.pid,
            "picked": self.picked or None,
            "timed_at": self.timed_at or None,
            "error": self.error or None,
            "refused": {p: why for p, (outcome, why) in self.outcomes.items() if outcome != StartPhase.PASSED.value},
            "passed": [p for p, (outcome, _) in self.outcomes.items() if outcome == StartPhase.PASSED.value],
            "shadow": self.shadow.report() if self.shadow is not None else None,
            "gate": self.gate.tally.report(now) if self.gate is not None else None,
        }
        if self.state is BuildState.BUILDING:
            report.update(
                phase=self.phase or "starting",
                profile=self.profile or None,
                index=self.index or None,
                count=self.count or None,
                phase_elapsed_s=round(now - self.phase_at, 1) if self.phase_at else None,
            )
        return report

    def line(self, now: float) -> str:
        """One phrase for `infervisor status`: what the builder does, or what it came to.

        No time left is guessed: one profile's compile takes seconds and the next one's minutes (an average over
        the profiles done was off six-fold), so the phrase says what is measured, the time so far and what is done.
        """
        if self.state is BuildState.BUILDING:
            where = f"{self.profile} ({self.index} of {self.count})" if self.index else (self.profile or "the model")
            elapsed = now - self.started_at if self.started_at is not None else 0.0
            done = len(self.outcomes)
            tail = f", {done} of {self.count} profiles decided" if done and self.count else ""
            doing = f"{self.phase} {where}" if self.phase else "starting the builder"
            paused = self.gate.tally.report(now) if self.gate is not None else None
            waits = f", paused {paused['paused_s']:.0f} s for requests" if paused and paused["pauses"] else ""
            return f"optimizing: {doing}, {elapsed:.0f} s{tail}{waits}"
        if self.state is BuildState.DONE:
            refused = len([o for o, _ in self.outcomes.values() if o != StartPhase.PASSED.value])
            return f"optimized: picked {self.picked or '?'}" + (f", {refused} refused" if refused else "")
        if self.state is BuildState.FAILED:
            return f"optimizing stopped: {self.error}"
        if self.state is BuildState.SHADOW and self.shadow is not None:
            return f"optimized, before the switch: {self.shadow.line()}"
        return "optimizing: waiting"


class BackgroundBuilds:
    """Every model's background build: starting builders, reading their progress, switching when one is done."""

    def __init__(
        self,
        config: Callable[[], Config],
        members: Callable[[str], Sequence[WorkerSlot] | None],
        switch: Callable[[str, str], None],
        children: Children,
        launcher: Callable[..., Launched] = launch_worker,
    ) -> None:
        self.config = config
        #: The model's worker slots (the builder runs on their cores, with one worker's threads).
        self.members = members
        #: Roll the model's workers over to what its builder picked (model, reason).
        self.switch = switch
        self.launcher = launcher
        #: Where a builder's end is noticed (`settle` judges it at the next tick) and its link read.
        self.children = children
        self.builds: dict[str, ModelBuild] = {}
        #: Per model, the refusals recorded in the cache (common/verdicts.py), read every _VERDICTS_EVERY_S for status.
        self.refusals: dict[str, dict[str, object]] = {}
        self.verdicts_read_at = -_VERDICTS_EVERY_S
        #: Each model's recorded served inputs (the builder's gate and timing read them from the cache).
        self.recorder = InputRecorder(config, members)

    def serves_first(self, model: ModelConfig) -> bool:
        """Whether a worker of `model` starts on what is ready only (its build is not done)."""
        if not needs_builder(model):
            return False
        build = self.builds.get(model.name)
        return build is None or build.state is not BuildState.DONE

    def build_of(self, name: str) -> ModelBuild | None:
        """The model's build, if it has one."""
        return self.builds.get(name)

    def tick(self, now: float, ready: Callable[[str], list[str] | None]) -> None:
        """Read the running builder, settle its end, and start the next one whose model serves.

        `ready(model)`: the profiles its members serve when every member serves, else None.
        """
        config = self.config()
        for name in list(self.builds):
            if name not in config.models or not needs_builder(config.models[name]):
                self.forget(name, "not built in the background any more")
        for name, model in config.models.items():
            if needs_builder(model) and name not in self.builds:
                self.builds[name] = ModelBuild(name)
        running = [b for b in self.builds.values() if b.running]
        for build in running:
            self.settle(build, config.models[build.model], now, ready)
        for build in [b for b in self.builds.values() if b.state is BuildState.SHADOW]:
            self.follow_shadow(build, config, config.models[build.model], now)
        self.recorder.tick(now)
        if now - self.verdicts_read_at >= _VERDICTS_EVERY_S:
            self.verdicts_read_at = now
            self.refusals = self.recorded_refusals(config)
        if any(b.running for b in self.builds.values()):
            return
        for build in self.builds.values():
            due = now >= build.child.next_start
            if build.state in (BuildState.WAITING, BuildState.BUILDING) and due and ready(build.model) is not None:
                self.start(build, config, config.models[build.model], now)
                return

    def start(self, build: ModelBuild, config: Config, model: ModelConfig, now: float) -> None:
        """Start the model's builder process (SCHED_IDLE, its own memory cap) on the cores its workers have."""
        cpus, threads = self.cores_of(model.name)
        assignment = Assignment(model.name, 0, cpus, 0, threads, True)
        capped = dataclasses.replace(model, max_memory_mb=builder_memory_mb(config, model))
        self.recorder.flush(model.name)  # what was served so far is on disk for the builder's gate and timing
        try:
            launched = self.launcher(capped, assignment, config, build.exits, build_only=True, background=True)
        except OSError as exc:  # the box is short of pids or memory: tried again next turn
            log.error("builder_spawn_failed", model=model.name, error=str(exc))
            return
        child = build.child
        owner = lambda message, frames: self.take(build, message, time.monotonic())  # noqa: E731
        self.children.adopt(child, launched.process, launched.link, (launched.worker_id, cpus, now), owner)
        build.gate = BuildGate(launched.process.pid, config.build_min_share)
        if build.started_at is None:
            build.started_at = now
        build.state, build.phase, build.phase_at = BuildState.BUILDING, "", now
        log.info("builder_started", model=model.name, pid=launched.process.pid, attempt=child.starts,
                 cpus=list(cpus), threads=threads)  # fmt: skip

    def gate(self, now: float, busy: bool) -> None:
        """Stop the running builder while serving is `busy`, continue it when not (or when the floor says so)."""
        config = self.config()
        for build in self.builds.values():
            if build.running and build.gate is not None:
                build.gate.reconcile(now, busy, build.phase, config.build_yield, config.build_min_share)

    def cores_of(self, name: str) -> tuple[tuple[int, ...], int]:
        """The cpus of the model's workers and the supervisor's own (with `pin_supervisor`, the ones no worker
        holds: a box with spare cores builds there), on which an idle-class builder only gets time serving
        leaves; and the threads of one worker, which the timing must use for its pick to hold when serving."""
        slots = self.members(name) or []
        cpus = sorted({cpu for slot in slots for cpu in slot.assignment.cpus} | os.sched_getaffinity(0))
        threads = slots[0].assignment.threads if slots else 1
        return tuple(cpus), threads

    def take(self, build: ModelBuild, message: wm.WorkerMessage, now: float) -> None:
        """One message of the builder's link, as the event loop read it: its PROGRESS, and its READY (the pick)."""
        if isinstance(message, wm.Ready):
            build.picked = message.profile
            build.notes = list(message.build_notes)
            timed = [note for note in message.build_notes if note.startswith(TIMED_AT_NOTE)]
            build.timed_at = timed[0].removeprefix(TIMED_AT_NOTE) if timed else ""
            return
        if not isinstance(message, wm.Progress):
            return
        try:
            phase = StartPhase(message.phase)
        except ValueError:
            return
        if phase in OUTCOME_PHASES:
            build.outcomes[message.profile] = (phase.value, " ".join(message.detail.split()))
            return
        if (phase.value, message.profile) != (build.phase, build.profile):
            build.phase_at = now
        build.phase, build.profile = phase.value, message.profile
        build.index, build.count = message.index or build.index, message.count or build.count

    def settle(
        self, build: ModelBuild, model: ModelConfig, now: float, ready: Callable[[str], list[str] | None]
    ) -> None:
        """A builder that ended: its end judged by lifecycle/exit_decision.py `decide_build_exit` (switch to its pick,
        start another at the next tick after a crash, or stop with the reason) and the verdict applied."""
        child = build.child
        code, pid = child.exit_code, child.pid
        if code is None:
            return  # running; the reaper (which killed what was left of its process group) has not seen it end
        self.children.links.drain(child)  # its READY (the pick), when it exited right after saying it
        if build.gate is not None:
            build.gate.close(now)
        how = describe_exit(code)
        kills_before = build.kills.get(build.profile, 0)
        facts = BuildExitFacts(code, how, child.starts, len(model.profiles), build.phase, build.profile, kills_before)
        verdict = decide_build_exit(facts)
        child.ended(how, verdict.restart_in, 0 if verdict.then is Then.DONE else child.ends_in_row + 1, now)
        if verdict.then is Then.DONE:
            self.finish(build, now, ready)
            return
        if verdict.then is Then.FAIL:
            build.state, build.ended_at, build.error = BuildState.FAILED, now, verdict.why
            log.error("builder_failed", model=build.model, error=build.error)
            return
        build.phase = "restarting"  # the next tick starts it again
        if verdict.kills is None:  # killed before it reached a profile (a stop, a reboot): nothing to blame
            log.warning("builder_interrupted", model=build.model, how=how)
            return
        build.kills[build.profile] = verdict.kills
        build.exits.append({"pid": pid, "how": how, "signal": -code, "killed_by_supervisor": verdict.interrupted})
        log.warning("builder_crashed", model=build.model, profile=build.profile, how=how, again=True,
                    profile_refused=not verdict.interrupted)  # fmt: skip

    def finish(self, build: ModelBuild, now: float, ready: Callable[[str], list[str] | None]) -> None:
        """Built: roll the workers over to the pick unless every one serves it already; a lossy pick not proven on
        live traffic yet runs in shadow first."""
        build.state, build.ended_at = BuildState.DONE, now
        served = ready(build.model) or []
        log.info(
            "builder_done", model=build.model, picked=build.picked, seconds=round(now - (build.started_at or now), 1)
        )
        model = self.config().models[build.model]
        proven = any(note.startswith(SHADOW_PASSED_NOTE) for note in build.notes)
        tried = build.shadow is not None and build.shadow.candidate == build.picked
        if model.shadow == "on" and lossy(build.picked) and not proven and not tried:
            open_dims = any(None in spec.shape[1:] for spec in model.inputs)
            build.state = BuildState.SHADOW
            build.shadow = ShadowRun(build.model, build.picked, model.shadow_rows, open_dims, now, self.children)
            log.info("shadow_started", model=build.model, profile=build.picked, rows_needed=model.shadow_rows)
            return
        if build.picked and served and all(p == build.picked for p in served):
            return
        self.switch(build.model, f"background build done: switching to {build.picked or 'its pick'}")

    def follow_shadow(self, build: ModelBuild, config: Config, model: ModelConfig, now: float) -> None:
        """Drive the pick's shadow; passed: record it and switch; refused: record it and build again (the builder
        then refuses the profile and picks the next); failed: switch (a worker does not serve it unproven)."""
        shadow = build.shadow
        if shadow is None:
            return
        outcome = shadow.tick(now, config, model, list(self.cores_of(build.model)[0]))
        if outcome is ShadowOutcome.RUNNING:
            return
        if outcome is not ShadowOutcome.FAILED:
            # A candidate the shadow's own start refused on recorded served inputs never said READY: its verdict is
            # kept under the spec key the builder's READY named, the same model, specs and tolerance.
            key = shadow.spec_key or spec_key_in(build.notes)
            self.record(config, build.model, shadow, key, refused=outcome is ShadowOutcome.REFUSED)
        if outcome is ShadowOutcome.REFUSED:
            self.builds[build.model] = ModelBuild(build.model, shadow=shadow)
            return
        build.state = BuildState.DONE
        self.switch(build.model, f"{shadow.line()}: switching")

    def record(self, config: Config, name: str, shadow: ShadowRun, key: str | None, refused: bool) -> None:
        """Keep the shadow's verdict beside the pick in the cache, under the spec key it ran on."""
        if key is None:
            log.error("shadow_verdict_not_recorded", model=name, profile=shadow.candidate, why="no spec key")
            return
        try:
            verdicts.record(resolve_cache_dir(config.cache_dir), key, name, shadow.candidate,
                            {"by": "shadow", **shadow.verdict}, refused=refused)  # fmt: skip
        except OSError as exc:
            log.error("shadow_verdict_not_recorded", model=name, profile=shadow.candidate, why=str(exc))

    @staticmethod
    def recorded_refusals(config: Config) -> dict[str, dict[str, object]]:
        """The refusals recorded for each model (shadow, live audit): model -> profile -> its record."""
        found: dict[str, dict[str, object]] = {}
        for each in verdicts.every(resolve_cache_dir(config.cache_dir)):
            if each.model in config.models and each.refused:
                found.setdefault(each.model, {}).update(each.refused)
        return found

    def offer(self, slot: WorkerSlot, request: PendingRequest, answer: list[Any]) -> None:
        """The broker's tap: an exact answer of a model whose pick is in shadow may be its next sample (never
        raises: a bug here costs a sample, never the reply)."""
        build = self.builds.get(slot.model.name)
        if build is None or build.state is not BuildState.SHADOW or build.shadow is None:
            return
        try:
            model = self.config().models.get(slot.model.name)
            if model is not None:
                build.shadow.offer(slot, request, answer, model.shadow_budget)
        except Exception:  # noqa: BLE001 - the shadow must not reach serving
            log.exception("shadow_offer_failed", model=slot.model.name)

    def forget(self, name: str, reason: str) -> None:
        """Drop a model's build (removed, or its chain changed): its builder is killed and reaped."""
        build = self.builds.pop(name, None)
        if build is not None and build.shadow is not None:
            build.shadow.stop()
        if build is not None and build.running:
            self.end(build, reason)

    def restart(self, name: str, reason: str) -> None:
        """Build the model again from scratch (a reload changed how its workers are built)."""
        self.forget(name, reason)

    def end(self, build: ModelBuild, reason: str) -> None:
        if not build.running:
            return
        log.info("builder_stopped", model=build.model, pid=build.child.pid, reason=reason)
        build.child.close()  # killed with its compilers, waited for: not an end to judge
        if build.gate is not None:
            build.gate.close(time.monotonic())

    def stop_all(self, reason: str) -> None:
        """The daemon stops: every builder goes (a build left half-done is never loaded; the next start builds), and
        the recorded inputs are written back."""
        self.recorder.stop()
        for build in self.builds.values():
            self.end(build, reason)
            if build.shadow is not None:
                build.shadow.stop()
