"""What live traffic proved about a model's profiles, kept beside the pick in the cache: refusals and shadow passes.

A refusal (by the shadow run or by the live audit) and a shadow pass are recorded per spec key: the sha256 of what
decides a profile's numerics for a model (its weights digest, input specs, tolerance, calibration set, layout),
as the worker computes it (`spec_key`). One file per spec key, `verdicts-<spec key>.json` in the cache folder,
0600, written whole by a rename, read only through the strict modes like every cache file. A change of the
model's weights, spec, tolerance or calibration gives another key: its old verdicts are not honoured any more (the
builder removes them, `forget_others`), and `infervisor fallback --model M --reset` removes the model's (`clear`).
Torch-free: the supervisor records and lists, the worker honours.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.common.profiles import PROFILES
from infervisor.common.strict_modes import UnsafePath, read_small_file
from infervisor.common.whole_file import write_whole

#: The file of one spec key's verdicts in the cache folder: `verdicts-<32 hex digits>.json`.
PREFIX, SUFFIX = "verdicts-", ".json"
#: A READY build note carrying the worker's spec key (the supervisor records verdicts under it).
SPEC_KEY_NOTE = "spec key "
#: A READY build note of a profile that passed the shadow for this spec: `<note><why>`.
SHADOW_PASSED_NOTE = "passed the shadow on live traffic: "
#: The skip reason of a lossy profile that has not passed the shadow yet (the background builder runs it).
UNPROVEN = "lossy: serves only after matching the served exact answers on live traffic (shadow)"
_MAX_BYTES = 1 << 20


def lossy(profile: str) -> bool:
    """Whether a profile computes in less than fp32 (int8, bf16): one that serves only after a shadow pass."""
    declared = PROFILES.get(profile)
    return declared is not None and declared.changes_numerics


def spec_key(digest: str, inputs: Sequence[Sequence[Any]], tolerance: Mapping[str, Any], calibration: str,
             channels_last: bool) -> str:  # fmt: skip
    """The key verdicts are kept under: everything that decides what a profile answers for this model."""
    key = {"model": digest, "inputs": [list(i) for i in inputs], "tolerance": dict(sorted(tolerance.items())),
           "calibration": calibration, "channels_last": channels_last}  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Verdicts:
    """One spec key's verdicts: profile -> the record of its refusal, and of its shadow pass."""

    model: str
    key: str
    refused: Mapping[str, Mapping[str, Any]]
    passed: Mapping[str, Mapping[str, Any]]

    def refusal(self, profile: str) -> str | None:
        """Why `profile` is refused for this spec, or None."""
        record = self.refused.get(profile)
        if record is None:
            return None
        return f"refused by {record.get('by', '?')} on live traffic: {record.get('why', '')}".rstrip(": ")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "spec_key": self.key, "refused": dict(self.refused), "passed": dict(self.passed)}


def path_for(root: Path, key: str) -> Path:
    """Where one spec key's verdicts live."""
    return root / f"{PREFIX}{key}{SUFFIX}"


def read(root: Path, key: str) -> Verdicts:
    """The verdicts recorded for `key` (none when the file is absent); UnsafePath or ValueError when it exists but is
    unsafe (another uid's, group-writable, a link from an unsafe place) or damaged: never honoured half-read."""
    path = path_for(root, key)
    if not os.path.lexists(path):
        return Verdicts("", key, {}, {})
    raw = json.loads(read_small_file(path, "verdicts file", _MAX_BYTES))
    if not isinstance(raw, dict) or raw.get("spec_key") != key:
        raise ValueError(f"verdicts file {path} is not this spec key's")
    refused, passed = raw.get("refused", {}), raw.get("passed", {})
    if not isinstance(refused, dict) or not isinstance(passed, dict):
        raise ValueError(f"verdicts file {path} is damaged")
    return Verdicts(str(raw.get("model", "")), key, refused, passed)


def record(root: Path, key: str, model: str, profile: str, verdict: Mapping[str, Any], refused: bool) -> Verdicts:
    """Add one verdict (a refusal, or a shadow pass) of `profile` under `key`, atomically; a refusal replaces a pass."""
    try:
        old = read(root, key)
    except (UnsafePath, ValueError, OSError):
        old = Verdicts(model, key, {}, {})  # replaced whole: an unsafe or damaged file is never merged from
    entry = {"profile": profile, "spec_key": key, "at": round(time.time(), 3), **verdict}
    refusals, passes = dict(old.refused), dict(old.passed)
    if refused:
        refusals[profile] = entry
        passes.pop(profile, None)
    else:
        passes[profile] = entry
    new = Verdicts(model, key, refusals, passes)
    _write(path_for(root, key), new.to_json())
    return new


def _write(path: Path, document: dict[str, Any]) -> None:
    write_whole(path, [json.dumps(document, indent=1).encode()])


def every(root: Path) -> list[Verdicts]:
    """Every readable verdicts file in the cache (an unsafe or damaged one is skipped, never read)."""
    found = []
    for path in sorted(root.glob(f"{PREFIX}*{SUFFIX}")) if root.is_dir() else []:
        key = path.name.removeprefix(PREFIX).removesuffix(SUFFIX)
        try:
            found.append(read(root, key))
        except (UnsafePath, ValueError, OSError):
            continue
    return found


def of_model(root: Path, model: str) -> list[Verdicts]:
    """Every readable verdicts file of `model` in the cache."""
    return [verdicts for verdicts in every(root) if verdicts.model == model]


def clear(root: Path, model: str) -> int:
    """Remove every verdict recorded for `model` (`infervisor fallback --reset`): how many refusals went."""
    gone = 0
    for verdicts in of_model(root, model):
        gone += len(verdicts.refused)
        path_for(root, verdicts.key).unlink(missing_ok=True)
    return gone


def forget_others(root: Path, model: str, key: str) -> None:
    """Remove `model`'s verdicts under any other spec key: its weights, spec, tolerance or calibration changed."""
    for verdicts in of_model(root, model):
        if verdicts.key != key:
            path_for(root, verdicts.key).unlink(missing_ok=True)
