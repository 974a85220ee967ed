"""Served inputs recorded as evidence: a bounded sample of what a model really serves, kept in the cache per spec key.

The supervisor samples successful requests (lifecycle/input_recorder.py) and keeps, per shape group (the inputs'
shapes without the batch dim), the newest few; the builder's gate checks profiles on them beside the validation
set, and pick "fastest" times at the served shape mix. One file per model and spec key (common/verdicts.py: a
change of the model's weights, spec, tolerance or calibration starts afresh), `inputs-<model>-<spec key>.bin` in
the cache folder, 0600, written whole by a rename and read only through the strict modes: a file another uid owns,
that others may write, or whose length or digest is not what it says, is refused with the reason, never loaded.

The format: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: model, spec key, per group the
times it was seen, per sample its group, when it was taken and its tensors' name, dtype and shape), the tensors'
bytes in that order, and the sha256 of everything before it. Torch-free: both sides read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infervisor.common.strict_modes import read_small_file
from infervisor.common.whole_file import write_whole
from infervisor.protocol.constants import DTYPE_ITEMSIZE

PREFIX, SUFFIX = "inputs-", ".bin"
MAGIC = b"INFERVISOR-RECORDED-INPUTS 1\n"
_LENGTH_BYTES, _DIGEST_BYTES = 8, 32
#: Room the header and framing may take beyond the samples' bytes before a file counts as over its cap.
HEADER_SLACK = 4 << 20
#: The default cap of one model's recording (config `record_inputs_mb`).
DEFAULT_CAP_MB = 64


@dataclass(frozen=True)
class RecordedTensor:
    """One input of a recorded request: its name, wire dtype, full shape (batch first) and raw little-endian bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class RecordedSample:
    """One recorded request: its shape group, when it was taken (unix time), and its inputs."""

    group: str
    at: float
    tensors: tuple[RecordedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(t.data) for t in self.tensors)


@dataclass
class Recording:
    """One spec key's recorded inputs: the samples, oldest first, and how often each group was seen when sampled."""

    model: str
    key: str
    samples: list[RecordedSample] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)

    def groups(self) -> dict[str, int]:
        """Group -> samples held of it."""
        held: dict[str, int] = {}
        for sample in self.samples:
            held[sample.group] = held.get(sample.group, 0) + 1
        return held


def group_of(shapes: Sequence[tuple[str, Sequence[int]]]) -> str:
    """The shape group of a request's inputs (name, full shape): `3x480x640`, or `image 3x480x640, mask 480x640`."""
    texts = [(name, "x".join(map(str, shape[1:]))) for name, shape in shapes]
    return texts[0][1] if len(texts) == 1 else ", ".join(f"{n} {s}" for n, s in texts)


def case_label(index: int, shapes: str) -> str:
    """The gate's name for a recorded served input, as its refusals say it: `recorded input 3 (served as x[1, 8])`."""
    return f"recorded input {index} (served as {shapes})"


def served_shape_in(text: str) -> str | None:
    """The shapes a refusal names with `case_label` (the first), else None."""
    found = _SERVED_AS.search(text)
    return found.group(1) if found else None


_SERVED_AS = re.compile(r"recorded input \d+ \(served as ([^()]*)\)")


def path_for(root: Path, key: str, model: str) -> Path:
    """Where one model's recording under one spec key lives (two models may share a spec key, never a file)."""
    return root / f"{PREFIX}{model}-{key}{SUFFIX}"


def encode(recording: Recording) -> list[bytes]:
    """The file's bytes as chunks (the samples' bytes by reference, never copied), its digest last."""
    header = {
        "model": recording.model,
        "spec_key": recording.key,
        "seen": dict(recording.seen),
        "samples": [
            {"group": s.group, "at": s.at,
             "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in s.tensors]}
            for s in recording.samples
        ],
    }  # fmt: skip
    text = json.dumps(header, separators=(",", ":")).encode()
    chunks = [MAGIC, len(text).to_bytes(_LENGTH_BYTES, "little"), text]
    chunks += [t.data for s in recording.samples for t in s.tensors]
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return [*chunks, digest.digest()]


def write(path: Path, chunks: Iterable[bytes]) -> None:
    """Write the file whole (common/whole_file.py): a reader sees the old recording or the new one, never a part."""
    write_whole(path, chunks)


def read(root: Path, key: str, model: str, cap_bytes: int) -> Recording | None:
    """The recording of `key` (None when there is none); UnsafePath when the file is another uid's, writable by
    others or in an unsafe place, ValueError when it is damaged, truncated, over its cap or another key's."""
    path = path_for(root, key, model)
    if not os.path.lexists(path):
        return None
    raw = read_small_file(path, "recorded-inputs file", cap_bytes + HEADER_SLACK)
    recording = decode(raw, key, str(path))
    if recording.model != model:
        raise ValueError(f"{path} is not {model!r}'s recording")
    return recording


def decode(raw: bytes, key: str, where: str) -> Recording:
    """Parse and verify the bytes of a recording (see the module's docstring); ValueError saying what is wrong."""
    head = len(MAGIC) + _LENGTH_BYTES
    if len(raw) < head + _DIGEST_BYTES or not raw.startswith(MAGIC):
        raise ValueError(f"{where} is not a recorded-inputs file (or is truncated)")
    if hashlib.sha256(raw[:-_DIGEST_BYTES]).digest() != raw[-_DIGEST_BYTES:]:
        raise ValueError(f"{where} is damaged or truncated: its sha256 does not match its content")
    length = int.from_bytes(raw[len(MAGIC) : head], "little")
    try:
        header = json.loads(raw[head : head + length])
        recording = Recording(str(header["model"]), str(header["spec_key"]))
        recording.seen = {str(g): int(n) for g, n in dict(header["seen"]).items()}
        offset = head + length
        for entry in header["samples"]:
            tensors = []
            for tensor in entry["tensors"]:
                dtype, shape = str(tensor["dtype"]), tuple(int(d) for d in tensor["shape"])
                size = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
                tensors.append(RecordedTensor(str(tensor["name"]), dtype, shape, raw[offset : offset + size]))
                offset += size
            recording.samples.append(RecordedSample(str(entry["group"]), float(entry["at"]), tuple(tensors)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where} is damaged: its header does not parse ({type(exc).__name__}: {exc})") from exc
    if offset != len(raw) - _DIGEST_BYTES:
        raise ValueError(f"{where} is damaged: its samples take {offset} bytes, the file holds {len(raw)}")
    if recording.key != key:
        raise ValueError(f"{where} is not this spec key's recording")
    return recording


def of_model(root: Path, model: str) -> list[Path]:
    """The recording files of `model` in the cache, whatever their spec key."""
    found = []
    for path in sorted(root.glob(f"{PREFIX}*{SUFFIX}")) if root.is_dir() else []:
        named, _, key = path.name.removeprefix(PREFIX).removesuffix(SUFFIX).rpartition("-")
        if named == model and len(key) == 32:
            found.append(path)
    return found


def clear(root: Path, model: str, keep: str | None = None) -> int:
    """Remove `model`'s recordings (all, or all but spec key `keep`'s): how many files went."""
    gone = 0
    for path in of_model(root, model):
        if keep is not None and path == path_for(root, keep, model):
            continue
        path.unlink(missing_ok=True)
        gone += 1
    return gone


def header_of(recording: Recording) -> dict[str, Any]:
    """What status shows of a recording: per group, samples held and times seen."""
    held = recording.groups()
    return {g: {"samples": held.get(g, 0), "seen": recording.seen.get(g, 0)} for g in sorted({*held, *recording.seen})}
