"""The slot state machine and the pool's lifecycle policy, driven step by step without worker processes."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import StartPhase
from infervisor.supervisor.core import state_diagram
from infervisor.supervisor.host.event_loop import EventLoop
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.routing.endpoints import ClientEndpoints
from infervisor.supervisor.routing.replies import client_replies
from infervisor.supervisor.routing.streams import Streams
from infervisor.supervisor.settings.config import Config, parse_config
from infervisor.supervisor.settings.config_diff import diff_configs
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.launcher import ExitRecord, Launched
from infervisor.supervisor.workers.slot import (
    TRANSITIONS,
    IllegalTransition,
    SlotState,
    WorkerSlot,
    allowed_transitions,
)
from infervisor.supervisor.workers.worker_inbox import WorkerInbox
from infervisor.supervisor.workers.worker_links import WorkerLinks
from infervisor.worker.profiles.attempts import AttemptLog

MODEL = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}


@dataclass
class Process:
    """Stands in for a worker process: the test decides when it exits and how."""

    pid: int
    code: int | None = None
    killed: bool = False

    def poll(self) -> int | None:
        """The exit code once the test (or a kill) ended it."""
        return self.code

    def kill(self) -> None:
        """SIGKILL: the next poll reports it."""
        self.killed = True
        self.code = -9

    def wait(self, timeout: float | None = None) -> int:
        """Only called once the process has ended."""
        return self.code if self.code is not None else -9


@dataclass
class Launches:
    """A launcher that starts no process: it records each launch, or refuses like an exhausted box."""

    processes: list[Process] = field(default_factory=list)
    refuse: bool = False

    def __call__(
        self,
        model: ModelConfig,
        assignment: Assignment,
        config: Config,
        recent_exits: Sequence[ExitRecord] = (),
        *,
        ready_only: bool = False,
    ) -> Launched:
        if self.refuse:
            raise OSError(11, "Resource temporarily unavailable")
        process = Process(1000 + len(self.processes))
        self.processes.append(process)
        return Launched(process, None, f"{model.name}.{assignment.slot}.{len(self.processes)}")


def _config(tmp: Path, **model: Any) -> Config:
    return parse_config(json.dumps({"max_restarts": 3, "models": {"tiny": {**MODEL, **model}}}), tmp)


def _plan(config: Config) -> dict[str, list[Assignment]]:
    return {
        name: [Assignment(name, i, (i,), 0, 1, False) for i in range(model.workers)]
        for name, model in config.models.items()
    }


class Rig:
    """A pool over a real broker and event loop, with a launcher that starts nothing."""

    def __init__(self, tmp: Path, **model: Any) -> None:
        self.tmp = tmp
        self.context: zmq.Context[Any] = zmq.Context()
        config = _config(tmp, **model)
        self.serving = ServingConfig(config)
        self.loop = EventLoop()
        anomalies = Anomalies()
        self.links = WorkerLinks(self.loop, anomalies)
        self.endpoints = ClientEndpoints(self.context, config, tmp)
        replies = client_replies(self.endpoints.sockets, self.serving, anomalies)
        streams = Streams(replies.queues, replies.finish)
        self.broker = Broker(self.endpoints, self.loop, self.links, self.serving, anomalies, replies, streams)
        self.launches = Launches()
        self.pool = WorkerPool(self.serving, _plan(config), self.links, self.broker, self.launches)
        self.inbox = WorkerInbox(anomalies, self.broker, self.pool, lambda slot, result: None)
        self.links.deliver_to(self.inbox.deliver, self.pool.link_broken)
        # The pool reads the clock itself where no tick hands it one (spawn, READY): start the rig's clock there.
        self.now = time.monotonic()

    def slots(self) -> list[WorkerSlot]:
        """The members of the model."""
        return self.pool.roster.members["tiny"]

    def ready(self, slot: WorkerSlot) -> None:
        """The slot's worker says READY."""
        self.pool.worker_ready(slot, wm.Ready(slot.proc.worker_id, 1, 1.0, 1.0, 1, [0], "eager", "", ""))

    def exit(self, slot: WorkerSlot, code: int) -> None:
        """The slot's process ends with `code`; the next tick reaps it."""
        assert isinstance(slot.proc.process, Process)
        slot.proc.process.code = code

    def tick(self, seconds: float = 0.02) -> None:
        """Let time pass and reconcile once."""
        self.now += seconds
        self.pool.tick(self.now)

    def close(self) -> None:
        """Close sockets."""
        self.broker.close()
        self.loop.close()
        self.context.term()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A one-worker pool of `tiny`."""
    made = Rig(tmp_path)
    yield made
    made.close()


def test_every_state_has_a_way_out_and_failed_only_leads_to_stopped() -> None:
    """The transition table has no dead end, and a FAILED slot can only be stopped (retired), never respawned."""
    for state in SlotState:
        assert allowed_transitions(state), f"{state} is a dead end"
    assert allowed_transitions(SlotState.FAILED) == {SlotState.STOPPED}
    assert SlotState.SERVING not in allowed_transitions(SlotState.STOPPED)


def test_an_illegal_transition_is_refused_loudly(tmp_path: Path) -> None:
    """Moving a stopped slot straight to SERVING is a supervisor bug and raises."""
    config = _config(tmp_path)
    slot = WorkerSlot(config.models["tiny"], Assignment("tiny", 0, (0,), 0, 1, False))
    with pytest.raises(IllegalTransition):
        slot.transition(SlotState.SERVING, "no process yet")
    assert slot.state is SlotState.STOPPED


def test_spawn_ready_and_a_crash_while_serving_respawns_at_once(rig: Rig) -> None:
    """STOPPED -> STARTING -> SERVING; the first crash while serving backs off for no time and respawns."""
    rig.pool.start()
    (slot,) = rig.slots()
    assert slot.state is SlotState.STARTING
    rig.ready(slot)
    assert slot.state is SlotState.SERVING
    rig.exit(slot, -9)
    rig.tick()
    assert slot.state is SlotState.STARTING, "a first crash while serving is respawned in the same tick"
    assert slot.notes.restarts == 1 and len(rig.launches.processes) == 2


def test_a_worker_that_never_gets_ready_backs_off_harder_then_fails(rig: Rig) -> None:
    """Exits before READY back off with growing delays; the third within the window fails the slot."""
    rig.pool.start()
    (slot,) = rig.slots()
    delays = []
    for _ in range(2):
        rig.exit(slot, 4)
        rig.tick()
        assert slot.state is SlotState.BACKOFF
        delays.append(slot.respawn_at - rig.now)
        rig.tick(delays[-1] + 0.01)
        assert slot.state is SlotState.STARTING
    assert delays[0] < delays[1]
    rig.exit(slot, 4)
    rig.tick()
    assert slot.state is SlotState.FAILED and "3 failures" in slot.reason
    rig.tick(60.0)
    assert slot.state is SlotState.FAILED and len(rig.launches.processes) == 3, "a failed slot is not respawned"
    assert rig.pool.roster.all_failed()


def test_a_spawn_the_box_refuses_backs_off_without_a_process(rig: Rig) -> None:
    """fork/exec failing (EAGAIN) moves STOPPED -> BACKOFF and is retried later, not fatal."""
    rig.launches.refuse = True
    rig.pool.start()
    (slot,) = rig.slots()
    assert slot.state is SlotState.BACKOFF and "spawn failed" in slot.reason
    rig.launches.refuse = False
    rig.tick(31.0)
    assert slot.state is SlotState.STARTING


def test_a_hung_worker_is_killed_once_and_replaced(tmp_path: Path) -> None:
    """A worker silent past its liveness is killed exactly once, however many ticks pass before the reap."""
    rig = Rig(tmp_path)
    try:
        rig.pool.start()
        (slot,) = rig.slots()
        rig.ready(slot)
        process = slot.proc.process
        assert isinstance(process, Process)
        process.kill = lambda: setattr(process, "killed", True)  # type: ignore[method-assign]
        slot.proc.last_heard = rig.now - 60.0
        rig.tick()
        rig.tick()
        assert process.killed and slot.proc.killed, "killed"
        process.code = -9
        rig.tick()
        assert slot.state is SlotState.STARTING and slot.proc.process is not process
    finally:
        rig.close()


def test_a_surge_rollout_keeps_the_old_worker_until_its_successor_is_ready(rig: Rig) -> None:
    """The successor warms beside the old worker; only when it is READY does it take the place and the old drains."""
    rig.pool.start()
    (old,) = rig.slots()
    rig.ready(old)
    assert rig.pool.restart("tiny", "test") == 1
    rig.tick()
    successor = rig.pool.rollout.successor
    assert successor is not None and successor.state is SlotState.STARTING
    assert rig.slots() == [old] and old.state is SlotState.SERVING
    rig.ready(successor)
    rig.tick()
    assert rig.slots() == [successor]
    assert old.state is SlotState.DRAINING and old in rig.pool.roster.extra
    rig.exit(old, 0)
    rig.tick()
    assert old.state is SlotState.STOPPED and old not in rig.pool.roster.extra
    assert rig.pool.rollout.completed == 1 and rig.pool.rollout.pending == 0


def test_a_successor_that_dies_before_ready_is_abandoned_and_the_old_worker_keeps_serving(rig: Rig) -> None:
    """A failed surge replacement stops the model's rollout; the old worker never left the pool."""
    rig.pool.start()
    (old,) = rig.slots()
    rig.ready(old)
    rig.pool.restart("tiny", "test")
    rig.tick()
    successor = rig.pool.rollout.successor
    assert successor is not None
    rig.exit(successor, 4)
    rig.tick()
    rig.tick()
    assert rig.slots() == [old] and old.state is SlotState.SERVING
    assert successor not in rig.pool.roster.extra and successor.state is SlotState.STOPPED
    assert rig.pool.rollout.last_error is not None and "old worker keeps serving" in rig.pool.rollout.last_error


def test_a_drain_first_rollout_takes_the_worker_out_before_starting_its_replacement(tmp_path: Path) -> None:
    """drain_first: the old worker drains and exits, then its replacement warms in the same place."""
    rig = Rig(tmp_path, rollout="drain_first")
    try:
        rig.pool.start()
        (old,) = rig.slots()
        rig.ready(old)
        rig.pool.restart("tiny", "test")
        rig.tick()
        assert rig.slots() == [] and old.state is SlotState.DRAINING and rig.pool.rollout.drain_step_under_way
        rig.exit(old, 0)
        rig.tick()
        rig.tick()
        (new,) = rig.slots()
        assert new is not old and new.state is SlotState.STARTING
        rig.ready(new)
        rig.tick()
        assert rig.pool.rollout.pending == 0
    finally:
        rig.close()


def test_scaling_down_retires_the_surplus_and_stop_ends_with_every_slot_stopped(tmp_path: Path) -> None:
    """A reload to fewer workers drains the extra one; a stop then stops the rest and the pool is finished."""
    rig = Rig(tmp_path, workers=2)
    try:
        rig.pool.start()
        for slot in rig.slots():
            rig.ready(slot)
        new = _config(tmp_path, workers=1)
        diff = diff_configs(rig.serving.current, new)
        rig.serving.replace(new)
        rig.pool.adopt(new, _plan(new), diff)
        (kept,) = rig.slots()
        (surplus,) = rig.pool.roster.extra
        assert surplus.state is SlotState.DRAINING and kept.state is SlotState.SERVING
        rig.pool.stop.begin(rig.now)
        rig.tick()
        assert kept.state is SlotState.STOPPING and surplus.state is SlotState.STOPPING
        for slot in (kept, surplus):
            rig.exit(slot, 0)
        rig.tick()
        assert rig.pool.stop.finished()
    finally:
        rig.close()


def _limits(rig: Rig, start_s: float, compile_s: float) -> None:
    """Serve the rig with these start and compile limits."""
    rig.serving.replace(
        dataclasses.replace(rig.serving.current, worker_start_timeout_s=start_s, compile_timeout_s=compile_s)
    )


def _enter(rig: Rig, slot: WorkerSlot, seconds: float, phase: StartPhase, profile: str = "", index: int = 0) -> None:
    """Let `seconds` pass in the current phase, then the worker reports `phase` (profile `index` of 3)."""
    rig.tick(seconds)
    rig.pool.worker_progress(slot, wm.Progress(phase.value, profile, index, 3 if index else 0, 0.0, ""), rig.now)


def test_builds_are_not_counted_by_the_start_limit_and_each_has_its_own_limit(rig: Rig) -> None:
    """Loading, checking and warm-up add up to the start limit; a longer build lives while under the compile limit."""
    _limits(rig, start_s=10.0, compile_s=30.0)
    rig.pool.start()
    (slot,) = rig.slots()
    _enter(rig, slot, 4.0, StartPhase.BUILDING, "aoti", 1)
    _enter(
        rig, slot, 25.0, StartPhase.CHECKING, "aoti", 1
    )  # 25 s of build: past the start limit, under the compile one
    _enter(rig, slot, 1.0, StartPhase.PASSED, "aoti", 1)
    _enter(rig, slot, 0.5, StartPhase.BUILDING, "int8_static", 2)
    _enter(rig, slot, 29.0, StartPhase.WAITING, "int8_static", 2)  # each build phase has its own 30 s
    _enter(rig, slot, 29.0, StartPhase.BUILDING, "int8_static", 2)
    _enter(rig, slot, 29.0, StartPhase.WARMING, "int8_static", 2)
    assert slot.state is SlotState.STARTING and not slot.proc.killed
    clock = slot.proc.start
    assert clock.counted(rig.now) == pytest.approx(5.5, abs=0.01) and clock.build_s == pytest.approx(112.0)
    rig.tick(4.0)
    assert not slot.proc.killed, "9.5 s counted, under the 10 s start limit"
    rig.tick(1.0)
    assert slot.proc.killed and slot.proc.compile_overrun is None, "the start limit is not a compile overrun"
    rig.tick()
    last_exit = slot.notes.last_exit or ""
    assert "not ready after 10 s of loading, checking and warming up" in last_exit, last_exit
    assert "builds took 112 s more, not counted" in last_exit


def test_a_build_over_the_compile_limit_is_killed_and_remembered_for_the_next_worker(rig: Rig) -> None:
    """Past compile_timeout_s the worker is killed; its exit record names the profile; two such skip it."""
    _limits(rig, start_s=10.0, compile_s=30.0)
    rig.pool.start()
    (slot,) = rig.slots()
    _enter(rig, slot, 1.0, StartPhase.BUILDING, "int8_static", 2)
    rig.tick(30.0)
    assert not slot.proc.killed
    rig.tick(0.5)
    overrun = slot.proc.compile_overrun
    assert slot.proc.killed and overrun is not None and overrun["profile"] == "int8_static"
    rig.tick()  # reaped: backs off
    last_exit = slot.notes.last_exit or ""
    assert "building profile int8_static (2 of 3) for 30 s, over compile_timeout_s (30 s)" in last_exit
    (first,) = rig.pool.exits.recent_exits["tiny"]
    assert first["killed_by_supervisor"] and first["compile_overrun"]["profile"] == "int8_static"
    stems = {"int8_static": "int8_static-key", "aoti": "aoti-key"}
    assert AttemptLog(None, stems, [first], 30.0).refusal("int8_static") is None, "one overrun is retried"
    second = {**first, "pid": 4242}
    twice = AttemptLog(None, stems, [first, second], 30.0)
    assert "overran the compile limit 2 times" in (twice.refusal("int8_static") or "")
    assert twice.refusal("aoti") is None
    assert AttemptLog(None, stems, [first, second], 60.0).refusal("int8_static") is None, "a raised limit retries"
    rig.pool.restart("tiny", "operator command", forget_overruns=True)
    assert all(e["compile_overrun"] is None for e in rig.pool.exits.recent_exits["tiny"])


def test_the_documented_state_diagram_is_the_transition_table() -> None:
    """docs/architecture.md's diagram is what workers/slot.py's TRANSITIONS renders, arrow for arrow."""
    text = state_diagram.DOCS.read_text()
    assert state_diagram.render(text) == text, "run `python -m infervisor.supervisor.core.state_diagram --write`"
    arrows = sum(len(moves) for moves in TRANSITIONS.values())
    assert state_diagram.diagram().count(" --> ") == arrows + 1  # and the initial [*] --> STOPPED


def test_a_respawn_replaces_the_process_record_whole_and_keeps_the_notes(rig: Rig) -> None:
    """What belonged to the dead process (its profile, kill, timings) goes with it; restarts and last exit stay."""
    rig.pool.start()
    (slot,) = rig.slots()
    rig.ready(slot)
    first = slot.proc
    assert first.profile == "eager" and first.ready_at > 0.0
    assert slot.kill("test kill")
    rig.tick()
    assert slot.state is SlotState.STARTING and slot.proc is not first
    assert slot.proc.profile is None and not slot.proc.killed and slot.proc.ready_at == 0.0
    assert first.profile == "eager" and first.killed, "the old record still says what that process was"
    assert slot.notes.restarts == 1 and "test kill" in (slot.notes.last_exit or "")


def test_a_rollout_target_is_applied_once_every_member_is_built_from_it(rig: Rig) -> None:
    """begin_rollout makes the target what workers are built from; the serving config changes only when all are."""
    rig.pool.start()
    (old,) = rig.slots()
    rig.ready(old)
    serving = rig.serving.current.models["tiny"]
    target = dataclasses.replace(serving, profiles=("eager", "jit"))
    rig.serving.begin_rollout(target)
    rig.pool.restart("tiny", "test")
    rig.tick()
    assert rig.serving.rolling() == ["tiny"] and rig.serving.model("tiny") == serving
    successor = rig.pool.rollout.successor
    assert successor is not None and successor.model == target
    rig.ready(successor)
    rig.tick()
    rig.tick()
    assert rig.serving.rolling() == [] and rig.serving.model("tiny") == target
    assert rig.serving.rollout_error("tiny") is None


def test_a_failed_rollout_drops_its_target_and_says_why_until_the_next_one(rig: Rig) -> None:
    """A successor that dies before READY fails the model's rollout: the old config serves and the error stays."""
    rig.pool.start()
    (old,) = rig.slots()
    rig.ready(old)
    serving = rig.serving.current.models["tiny"]
    rig.serving.begin_rollout(dataclasses.replace(serving, profiles=("eager", "jit")))
    rig.pool.restart("tiny", "test")
    rig.tick()
    successor = rig.pool.rollout.successor
    assert successor is not None
    rig.exit(successor, 4)
    rig.tick()
    rig.tick()
    error = rig.serving.rollout_error("tiny")
    assert rig.serving.rolling() == [] and rig.serving.model("tiny") == serving
    assert error is not None and "replacement failed" in error
    assert rig.pool.roster.model_errors(rig.pool.rollout.failed) == {"tiny": error}
    rig.serving.begin_rollout(dataclasses.replace(serving, profiles=("eager", "jit")))
    assert rig.serving.rollout_error("tiny") is None, "a new rollout forgets the last one's failure"
