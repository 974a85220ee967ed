"""The one demultiplexer of worker links: each message is decoded once and handed straight to its owner.

A background builder's, audit's or shadow's link holds messages for one owner only (`deliver_to_owner`).

Replies go to the broker (which answers the client); READY, PROGRESS, LOAD_ERROR and a drained
worker go to the pool (which alone changes a slot's state); canary results to whoever judges them
(the canary monitor, through the callable it is built with); profiler reports are kept on the slot
for status. A link that lost its framing reaches the pool from the worker links directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.errors import ProtocolError
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.workers.slot import WorkerSlot

log = structlog.get_logger("supervisor")

#: Judges a worker's answer to a golden-input check (and acts on the verdict).
CanaryJudge = Callable[[WorkerSlot, wm.CanaryResult], None]
#: The owner of another kind of child (background builder, audit or shadow process): each decoded message, with its
#: data frames (views into the link's buffer, valid during the call).
ChildOwner = Callable[[wm.WorkerMessage, list[memoryview]], None]


class ReplyTaker(Protocol):
    """The broker, as the inbox sees it."""

    def worker_ready(self, slot: WorkerSlot) -> None:
        """A worker is ready: it may be given requests."""

    def on_reply(self, slot: WorkerSlot, reply: wm.Reply | None, frames: list[Any], why: str = "") -> bool:
        """Answer the client (reply None: a garbled one); True when a draining worker now holds nothing."""
        ...


class Lifecycle(Protocol):
    """The pool, as the inbox sees it."""

    def worker_ready(self, slot: WorkerSlot, ready: wm.Ready) -> None:
        """A starting worker said READY."""

    def worker_progress(self, slot: WorkerSlot, progress: wm.Progress) -> None:
        """A starting worker entered a phase."""

    def worker_load_error(self, slot: WorkerSlot, error: wm.LoadError) -> None:
        """A starting worker cannot load its model and says why."""

    def worker_drained(self, slot: WorkerSlot) -> None:
        """A draining worker answered its last request."""


def looks_like_reply(header: memoryview) -> bool:
    """True for a msgpack array whose first element is the REPLY type (readable that far, garbled after)."""
    head = bytes(header[:2])
    return len(head) > 1 and 0x90 <= head[0] <= 0x9F and head[1] == wm.Reply.TYPE


def keep_profile(slot: WorkerSlot, result: wm.ProfileResult) -> None:
    """Keep a worker's torch.profiler report for status (malformed operator JSON is kept as an error)."""
    try:
        operators = json.loads(result.operators)
    except ValueError:
        operators = {"error": "the worker sent operators that are not JSON"}
    slot.notes.last_profile = {
        "seq": result.seq,
        "requests": result.requests,
        "operators": operators,
        "ended": result.ended,
    }
    slot.proc.profile_started_at = None
    log.info("profile_received", slot=slot.name, seq=result.seq, requests=result.requests, ended=result.ended)


class WorkerInbox:
    """Reads nothing itself: the worker links hand it every whole message, in order."""

    def __init__(self, anomalies: Anomalies, broker: ReplyTaker, pool: Lifecycle, judge_canary: CanaryJudge) -> None:
        self.anomalies = anomalies
        self.broker = broker
        self.pool = pool
        self.judge_canary = judge_canary

    def deliver(self, slot: WorkerSlot, messages: list[list[memoryview]]) -> None:
        """Act on the whole messages a worker's link held, in order."""
        for frames in messages:
            try:
                self.on_message(slot, frames)
            except Exception:  # a bug on one message must cost that message, not the daemon
                log.exception("worker_message_crashed")
                self.anomalies.count("internal_error")

    def on_message(self, slot: WorkerSlot, frames: list[memoryview]) -> None:
        """Decode one worker message and hand it to its owner; malformed headers are counted and dropped."""
        try:
            message = wm.decode(frames[0])
        except ProtocolError as exc:
            self.anomalies.count("worker_message_malformed", f"{slot.name}: {exc.message}")
            # Workers answer in order, so a garbled REPLY is the answer to the oldest request in hand;
            # other garbage is only counted.
            if looks_like_reply(frames[0]) and self.broker.on_reply(slot, None, [], exc.message):
                self.pool.worker_drained(slot)
            return
        slot.proc.last_heard = time.monotonic()
        if isinstance(message, wm.Reply):
            if self.broker.on_reply(slot, message, frames[1:]):
                self.pool.worker_drained(slot)
        elif isinstance(message, wm.Ready):
            self.pool.worker_ready(slot, message)
            self.broker.worker_ready(slot)
        elif isinstance(message, wm.Progress):
            self.pool.worker_progress(slot, message)
        elif isinstance(message, wm.Stats):
            slot.proc.threads_seen = message.threads
        elif isinstance(message, wm.CanaryResult):
            self.judge_canary(slot, message)
        elif isinstance(message, wm.ProfileResult):
            keep_profile(slot, message)
        elif isinstance(message, wm.LoadError):
            self.pool.worker_load_error(slot, message)


def deliver_to_owner(name: str, messages: list[list[memoryview]], owner: ChildOwner, anomalies: Anomalies) -> None:
    """Decode each whole message of a builder's, audit's or shadow's link once and hand it to the child's owner;
    malformed headers are counted and dropped, and a bug on one message costs that message, not the daemon."""
    for frames in messages:
        try:
            message = wm.decode(frames[0])
        except ProtocolError as exc:
            anomalies.count("worker_message_malformed", f"{name}: {exc.message}")
            continue
        try:
            owner(message, frames[1:])
        except Exception:  # noqa: BLE001 - contained like a serving worker's message (WorkerInbox.deliver)
            log.exception("worker_message_crashed", child=name)
            anomalies.count("internal_error")
