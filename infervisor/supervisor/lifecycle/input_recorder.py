"""The served-inputs recorder: a bounded sample of each model's successful requests, kept as evidence in the cache.

The broker's tap offers each successful answer (`offer`); the recorder takes the next one once SAMPLE_EVERY_S has
passed since the last it took (longer after a large one: at most BYTES_PER_S are copied), so a request that is not
taken costs one clock read. A taken request's inputs (never one a client left in shared memory, nor a stream's step)
are copied into its shape group's queue, the newest PER_GROUP of each group kept; past the model's cap
(`record_inputs_mb`) the oldest samples of any group go, so the recording never grows past it. Each sampling also
counts the group it saw: the served shape mix pick "fastest" times at.

The recording belongs to the spec key the serving workers report (common/verdicts.py): a change of the model's
weights, spec, tolerance or calibration starts a new one and removes the old. It is loaded from the cache when a
key is first seen (a file another uid owns, that others may write, or that is damaged is refused with the reason,
shown in status, and never loaded) and written back whole (common/recorded_inputs.py) every PERSIST_EVERY_S while
it changed, before a builder starts, and when the daemon stops. The write runs on a thread of its own: it is handed
the file's chunks (immutable bytes) and touches nothing else, so the loop never waits on a large file's fsync.
`record_inputs: false` records nothing and removes the model's recordings (a privacy-bound box).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from infervisor.common import recorded_inputs as files
from infervisor.common.recorded_inputs import RecordedSample, RecordedTensor, Recording
from infervisor.common.strict_modes import UnsafePath
from infervisor.common.verdicts import SPEC_KEY_NOTE
from infervisor.protocol.client_messages import decode_infer
from infervisor.protocol.errors import ProtocolError
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.workers.slot import WorkerSlot

log = structlog.get_logger("supervisor")

#: The least time between two samples of one model.
SAMPLE_EVERY_S = 0.25
#: Bytes a second the sampling copies at most per model: after a sample of N bytes the next waits N / BYTES_PER_S.
BYTES_PER_S = 4 << 20
#: Samples kept per shape group (the newest).
PER_GROUP = 16
#: How often a changed recording is written back.
PERSIST_EVERY_S = 30.0
#: How often the serving workers' spec key is looked at (a new key loads its recording).
KEY_EVERY_S = 1.0


def spec_key_of(slot: WorkerSlot) -> str | None:
    """The spec key the slot's worker reported in its READY notes (None before READY, or for an eager-only chain)."""
    for note in slot.proc.build_notes:
        if note.startswith(SPEC_KEY_NOTE):
            return note.removeprefix(SPEC_KEY_NOTE)
    return None


class _Write:
    """One write of a recording's file on a thread of its own: the chunks in, an error text (or "") out."""

    def __init__(self, path: Path, chunks: list[bytes]) -> None:
        self.path, self.error = path, ""
        self.thread = threading.Thread(target=self.run, args=(chunks,), name="record-inputs", daemon=True)
        self.thread.start()

    def run(self, chunks: list[bytes]) -> None:
        try:
            files.write(self.path, chunks)
        except OSError as exc:
            self.error = f"{self.path}: {exc.strerror or exc}"

    def done(self) -> bool:
        return not self.thread.is_alive()


@dataclass
class ModelRecording:
    """One model's recording as the supervisor holds it."""

    name: str
    recording: Recording | None = None
    #: Why the cache's file was not loaded (unsafe, damaged), shown in status until a write replaces it.
    refused: str = ""
    next_at: float = 0.0
    changed: bool = False
    persisted_at: float = 0.0
    writing: _Write | None = None
    write_error: str = ""
    taken: int = 0


class InputRecorder:
    """Every model's recording: sampled by the broker's tap, loaded and written back on the loop's turns."""

    def __init__(self, config: Callable[[], Config], members: Callable[[str], Sequence[WorkerSlot] | None]) -> None:
        self.config = config
        self.members = members
        self.models: dict[str, ModelRecording] = {}
        self.keys_read_at = -KEY_EVERY_S
        #: Set once the daemon stops: what is answered during the grace period is not recorded any more.
        self.stopped = False
        #: Models with `record_inputs: false` whose recordings were removed already.
        self.off: set[str] = set()

    def root(self) -> Path:
        return resolve_cache_dir(self.config().cache_dir)

    # ---- the broker's side ----------------------------------------------------------------------

    def offer(self, slot: WorkerSlot, request: PendingRequest, frames: list[Any]) -> None:
        """The broker's tap: maybe take this served request's inputs (never raises, never blocks)."""
        entry = self.models.get(slot.model.name)
        if entry is None or entry.recording is None or self.stopped:
            return
        now = time.monotonic()
        if now < entry.next_at or request.reader is not None or request.step is not None:
            return
        try:
            self.take(entry, entry.recording, slot, request, now)
        except Exception:  # noqa: BLE001 - a bug here costs a sample, never the reply
            log.exception("record_inputs_failed", model=slot.model.name)

    def take(self, entry: ModelRecording, recording: Recording, slot: WorkerSlot, request: PendingRequest,
             now: float) -> None:  # fmt: skip
        if spec_key_of(slot) != recording.key:
            return  # a worker of another spec (a rollout under way): its inputs are another recording's
        views = [memoryview(frame) for frame in request.frames]
        try:
            header = decode_infer(views[0], [len(v) for v in views[1:]], self.config().max_frame_bytes)
        except ProtocolError:
            return
        if not header.inputs or any(d.shm is not None for d in header.inputs):
            return
        group = files.group_of([(d.name, d.shape) for d in header.inputs])
        recording.seen[group] = recording.seen.get(group, 0) + 1
        size = sum(len(v) for v in views[1:])
        entry.next_at = now + max(SAMPLE_EVERY_S, size / BYTES_PER_S)
        cap = slot.model.record_inputs_mb << 20
        if size > cap:
            return
        pairs = zip(header.inputs, views[1:], strict=True)
        tensors = tuple(RecordedTensor(d.name, d.dtype, d.shape, v.tobytes()) for d, v in pairs)
        recording.samples.append(RecordedSample(group, time.time(), tensors))
        entry.taken += 1
        entry.changed = True
        _trim(recording, cap)

    # ---- the loop's turns -----------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Load a newly seen spec key's recording, finish writes, write back what changed (every PERSIST_EVERY_S)."""
        config = self.config()
        for name in [n for n in self.models if n not in config.models]:
            self.models.pop(name)
        for entry in self.models.values():
            if entry.writing is not None and entry.writing.done():
                entry.write_error, entry.writing = entry.writing.error, None
                entry.refused = entry.refused if entry.write_error else ""  # the refused file is replaced
                if entry.write_error:
                    log.error("recorded_inputs_not_written", model=entry.name, error=entry.write_error)
        if now - self.keys_read_at >= KEY_EVERY_S:
            self.keys_read_at = now
            for name, model in config.models.items():
                if not model.record_inputs:
                    self.disable(name)
                    continue
                self.off.discard(name)
                self.follow_key(name, model.record_inputs_mb << 20)
        for entry in self.models.values():
            if entry.changed and now - entry.persisted_at >= PERSIST_EVERY_S:
                self.persist(entry, now)

    def follow_key(self, name: str, cap: int) -> None:
        """Start the recording of the spec key the model's serving workers report, loading what the cache holds."""
        entry = self.models.setdefault(name, ModelRecording(name))
        keys = {key for slot in self.members(name) or [] if (key := spec_key_of(slot)) is not None}
        if len(keys) != 1 or (entry.recording is not None and entry.recording.key in keys):
            return  # none known yet, or a rollout between two specs: the current recording stays
        (key,) = keys
        root = self.root()
        entry.recording, entry.refused, entry.changed = Recording(name, key), "", False
        try:
            removed = files.clear(root, name, keep=key)  # the spec changed: what was recorded for the old one goes
            if removed:
                log.info("recorded_inputs_dropped", model=name, files=removed, why="the model's spec key changed")
            found = files.read(root, key, name, cap)
        except (UnsafePath, ValueError, OSError) as exc:
            entry.refused = str(exc)
            log.error("recorded_inputs_refused", model=name, error=entry.refused)
            return
        if found is not None:
            entry.recording = found
            entry.changed = _trim(found, cap)
            log.info("recorded_inputs_loaded", model=name, samples=len(found.samples), bytes=found.nbytes)

    def persist(self, entry: ModelRecording, now: float, wait: bool = False) -> None:
        """Write the recording back (on its thread; `wait`: until it is on disk)."""
        if entry.writing is not None:
            entry.writing.thread.join()
            entry.write_error, entry.writing = entry.writing.error, None
        recording = entry.recording
        if recording is None or not entry.changed:
            return
        entry.changed, entry.persisted_at = False, now
        entry.writing = _Write(files.path_for(self.root(), recording.key, entry.name), files.encode(recording))
        if wait:
            entry.writing.thread.join()
            entry.write_error, entry.writing = entry.writing.error, None
            entry.refused = "" if not entry.write_error else entry.refused

    def flush(self, name: str) -> None:
        """Before a builder starts: what was recorded is on disk for its gate and its timing."""
        entry = self.models.get(name)
        if entry is not None:
            self.persist(entry, time.monotonic(), wait=True)

    def stop(self) -> None:
        """The daemon stops: every recording that changed is written back."""
        self.stopped = True
        for entry in self.models.values():
            self.persist(entry, time.monotonic(), wait=True)

    def clear(self, name: str) -> int:
        """Forget the model's recording, in memory and in the cache (`infervisor fallback --reset`)."""
        entry = self.models.pop(name, None)
        if entry is not None and entry.writing is not None:
            entry.writing.thread.join()
        return files.clear(self.root(), name)

    def disable(self, name: str) -> None:
        """`record_inputs: false`: nothing is kept, and what the cache held of the model goes."""
        if name in self.off:
            return
        self.off.add(name)
        try:
            removed = self.clear(name)
        except OSError as exc:
            log.error("recorded_inputs_not_removed", model=name, error=str(exc))
            return
        if removed:
            log.info("recorded_inputs_dropped", model=name, files=removed, why="record_inputs is false")

    # ---- what operators see ---------------------------------------------------------------------

    def report(self, name: str) -> dict[str, object] | None:
        """The model's `recorded_inputs` object in status (None when it records nothing)."""
        model = self.config().models.get(name)
        if model is None or not model.record_inputs:
            return None
        entry = self.models.get(name)
        recording = entry.recording if entry is not None else None
        cap = model.record_inputs_mb << 20
        if entry is None or recording is None:
            return {"state": "waiting for a serving worker's spec key", "samples": 0, "bytes": 0, "cap_bytes": cap,
                    "file": None, "groups": {}, "refused": None}  # fmt: skip
        return {
            "state": "recording",
            "samples": len(recording.samples),
            "bytes": recording.nbytes,
            "cap_bytes": cap,
            "file": str(files.path_for(self.root(), recording.key, name)),
            "spec_key": recording.key,
            "groups": files.header_of(recording),
            "taken": entry.taken,
            "refused": entry.refused or None,
            "write_error": entry.write_error or None,
        }


def _trim(recording: Recording, cap: int) -> bool:
    """Keep the newest PER_GROUP samples of each group and, past `cap` bytes, drop the oldest: whether any went."""
    held: dict[str, int] = {}
    kept: list[RecordedSample] = []
    for sample in reversed(recording.samples):
        held[sample.group] = held.get(sample.group, 0) + 1
        if held[sample.group] <= PER_GROUP:
            kept.append(sample)
    kept.reverse()
    total = sum(s.nbytes for s in kept)
    while kept and total > cap:
        total -= kept.pop(0).nbytes
    dropped = len(kept) != len(recording.samples)
    recording.samples[:] = kept
    return dropped
