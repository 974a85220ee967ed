"""What a bundle's manifest may say, read strictly: its layout names, the entry suffixes, the record kinds.

A manifest is checked whole before any member is read: its types, every file name (an entry's stem plus one
of the known suffixes, a record's name one of the record kinds), every sha256 and size, and each entry's stem
against its key. What it lists is the only thing the import will accept as a member.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from infervisor.supervisor.toolkit.bundle_tar import BundleError

MANIFEST = "manifest.json"
PACKAGES = "packages/"
RECORDS = "records/"
#: Suffixes of the files that make one cache entry (`<stem><suffix>`); locks, `.failed` markers and temp files
#: stay home: a refusal travels only inside the signed manifest, never as a marker file.
ENTRY_SUFFIXES = (".json", ".sha256", ".bin.sha256", ".bin", ".buckets.json", ".xml", ".pt2")
#: The kinds of record a bundle carries beside the packages, each as the pattern of its file name in the cache.
#: A new kind is one more line here: export, signing, import and install follow.
RECORD_KINDS: tuple[re.Pattern[str], ...] = (
    re.compile(r"pick-[0-9a-f]{32}\.json"),  # a fastest pick (infervisor/worker/profiles/pick_record.py)
    # What live traffic proved of a spec key's lossy profiles: shadow passes and refusals (common/verdicts.py).
    re.compile(r"verdicts-[0-9a-f]{32}\.json"),
)
#: Files the import reads into memory (keys, digests, bucket tables, records) are at most this big.
MAX_SMALL_FILE_BYTES = 1 << 20
_LARGE_SUFFIXES = (".bin", ".xml", ".pt2")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STEM = re.compile(r"[a-z0-9_]+-[0-9a-f]{32}")
_REFUSAL_FIELDS = ("model", "profile", "outcome", "reason")
_CHUNK = 1 << 20


def is_record(name: str) -> bool:
    """Whether `name` is a record file of one of the kinds a bundle carries."""
    return any(kind.fullmatch(name) for kind in RECORD_KINDS)


def stem_for(profile: str, key: dict[str, Any]) -> str:
    """The name the workers give this key's files (infervisor/worker/profiles/cache.py, ArtifactCache.stem_for)."""
    return f"{profile}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}"


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _described(value: Any, where: str) -> dict[str, Any]:
    """A `{sha256, size}` map, checked."""
    ok = isinstance(value, dict) and isinstance(value.get("sha256"), str) and _SHA256.fullmatch(value["sha256"])
    size = value.get("size") if isinstance(value, dict) else None
    if not ok or not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BundleError(f"{MANIFEST}: {where} has no valid sha256 and size")
    return {"sha256": value["sha256"], "size": size}


def _entry(entry: Any, members: dict[str, dict[str, Any]]) -> None:
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), dict) for k in ("key", "files")):
        raise BundleError(f"{MANIFEST}: an entry is not an object with a key and files")
    stem, profile = entry.get("stem"), entry.get("profile")
    if not isinstance(stem, str) or not _STEM.fullmatch(stem) or stem != stem_for(str(profile), entry["key"]):
        raise BundleError(f"{MANIFEST}: entry {stem!r} does not name its own key (stem differs from the key's sha256)")
    for name, described in entry["files"].items():
        suffix = name[len(stem) :] if isinstance(name, str) and name.startswith(stem) else None
        if suffix not in ENTRY_SUFFIXES:
            raise BundleError(f"{MANIFEST}: {name!r} is not a file of entry {stem} (known suffixes: "
                              f"{', '.join(ENTRY_SUFFIXES)}): refused")  # fmt: skip
        _add(members, PACKAGES + name, _small(name, _described(described, name), suffix in _LARGE_SUFFIXES))
    files = entry["files"]
    if f"{stem}.json" not in files or not any(f"{stem}{s}" in files for s in (".pt2", ".xml")):
        raise BundleError(f"{MANIFEST}: entry {stem} has no key file or no package")


def _small(name: str, described: dict[str, Any], large: bool) -> dict[str, Any]:
    """`described`, unless a file that is read into memory is declared over MAX_SMALL_FILE_BYTES."""
    if not large and described["size"] > MAX_SMALL_FILE_BYTES:
        raise BundleError(f"{MANIFEST}: {name} declares {described['size']:,} bytes, over the "
                          f"{MAX_SMALL_FILE_BYTES:,}-byte cap of a key, digest or record file: refused")  # fmt: skip
    return described


def _add(members: dict[str, dict[str, Any]], name: str, described: dict[str, Any]) -> None:
    if name in members:
        raise BundleError(f"{MANIFEST}: {name} is listed twice")
    members[name] = described


def _refusal(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(value.get(f), str) for f in _REFUSAL_FIELDS):
        raise BundleError(f"{MANIFEST}: a refusal is not {{{', '.join(_REFUSAL_FIELDS)}}} strings")
    return {f: value[f] for f in _REFUSAL_FIELDS}


def parse_manifest(data: bytes, version: int) -> dict[str, Any]:
    """The manifest of `data`, checked whole, plus `members`: each member path it lists with its sha256 and size."""
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the interpreter's depth
        raise BundleError(f"{MANIFEST} is not valid JSON of a sane depth: {str(exc)[:200]}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != version:
        raise BundleError(f"{MANIFEST} is not a bundle manifest of format {version}")
    unknown = sorted(set(manifest) - {"format", "capability", "entries", "records", "refusals"})
    if unknown:
        raise BundleError(f"{MANIFEST} has keys a bundle does not have: {unknown}")
    entries, records, refusals = manifest.get("entries"), manifest.get("records"), manifest.get("refusals")
    if not isinstance(manifest.get("capability"), dict):
        raise BundleError(f"{MANIFEST} has no capability")
    if not isinstance(entries, list) or not isinstance(records, list) or not isinstance(refusals, list):
        raise BundleError(f"{MANIFEST} has no entries, records or refusals lists")
    members: dict[str, dict[str, Any]] = {}
    for entry in entries:
        _entry(entry, members)
    for record in records:
        name = record.get("name") if isinstance(record, dict) else None
        if not isinstance(name, str) or not is_record(name):
            raise BundleError(f"{MANIFEST}: record {name!r} is not of a kind a bundle carries: refused")
        _add(members, RECORDS + name, _small(name, _described(record, name), False))
    manifest["refusals"] = [_refusal(r) for r in refusals]
    manifest["members"] = members
    return manifest
