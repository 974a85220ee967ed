"""A cache a fleet can share: the compiled packages of one box as a bundle that another box verifies and installs.

A bundle is an uncompressed tar: `manifest.json` first, then `packages/<file>` for every file of every
package entry. The manifest holds the capability key of the box that built it (torch's CPU capability,
the CPU's full flag digest, the torch, torchao and openvino versions), and per entry its profile, its
cache key (the spec key: model digest, inputs, options, versions) and the sha256 of each of its files.

Importing refuses the whole bundle, installing nothing, when it is not a safe file of ours (strict
modes), when a member is anything but a plain file under `packages/` (a link, a device, a path that
climbs out), when a member is missing from the manifest or the manifest from the members, when a sha256
differs from the manifest's (a corrupted bundle, or a manifest that lies), or when a key does not name its
own file. Entries built for another capability key are refused one by one, with the field that differs;
the others are installed into the cache as the workers write their own packages: each file synced and
renamed into place under the entry's lock, the package itself last. The workers check each package's
sha256 again at every load, as for packages they built.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from infervisor.common.cpuinfo import cpu_flags_digest
from infervisor.common.strict_modes import UnsafePath, check_file, check_stat, check_tree

#: The manifest's own version: a bundle of another layout is refused.
BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
PACKAGES = "packages/"
#: Suffixes of the files that make one cache entry (`<stem><suffix>`); locks, markers and temp files stay home.
ENTRY_SUFFIXES = (".json", ".sha256", ".bin.sha256", ".bin", ".buckets.json", ".xml", ".pt2")
#: The key fields that say which machine and software a package runs on: a bundle entry must match all of them.
CAPABILITY_FIELDS = ("cpu_capability", "cpu_flags", "torch", "torchao")
#: The capability key of this box, read by the interpreter the workers run (torch is never imported here).
_PROBE = (
    "import json, torch, importlib.metadata as m\n"
    "def v(n):\n"
    "    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return None\n"
    "print(json.dumps({'cpu_capability': torch.backends.cpu.get_cpu_capability(), 'torch': torch.__version__,"
    " 'torchao': v('torchao'), 'openvino': v('openvino')}))"
)


class BundleError(Exception):
    """The bundle is refused whole; nothing of it was installed. The message says why."""


@dataclass
class ImportOutcome:
    """What an import did: entries installed, already present, and refused (stem: reason)."""

    installed: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def capability_key() -> dict[str, Any]:
    """This box's capability key: what a package's key must hold to run here."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise BundleError(f"cannot read this box's capability key (torch): {done.stderr.strip()[-300:]}")
    key: dict[str, Any] = json.loads(done.stdout)
    key["cpu_flags"] = cpu_flags_digest()
    return key


def stem_for(profile: str, key: dict[str, Any]) -> str:
    """The name the workers give this key's files (infervisor/worker/profiles/cache.py, ArtifactCache.stem_for)."""
    return f"{profile}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_entries(cache: Path) -> dict[str, dict[str, Any]]:
    """Each complete package entry of the cache by stem: its key (its `.json`) and the files that make it."""
    entries: dict[str, dict[str, Any]] = {}
    for key_file in sorted(cache.glob("*.json")):
        stem = key_file.name.removesuffix(".json")
        if stem.endswith(".buckets") or stem.startswith("pick-"):
            continue
        try:
            key = json.loads(key_file.read_text())
        except (OSError, ValueError):
            continue
        files = [f"{stem}{suffix}" for suffix in ENTRY_SUFFIXES if (cache / f"{stem}{suffix}").is_file()]
        package = any(name.endswith((".pt2", ".xml")) for name in files)
        if isinstance(key, dict) and package and stem == stem_for(stem.rpartition("-")[0], key):
            entries[stem] = {"profile": stem.rpartition("-")[0], "key": key, "files": files}
    return entries


def export_bundle(cache: Path, destination: Path) -> dict[str, Any]:
    """Write the cache's package entries to `destination` (through a temp file renamed into place); the manifest."""
    try:
        check_tree(cache, f"cache_dir {cache}")
    except UnsafePath as exc:
        raise BundleError(str(exc)) from exc
    entries = cache_entries(cache)
    if not entries:
        raise BundleError(f"{cache} holds no compiled package to export")
    manifest: dict[str, Any] = {"format": BUNDLE_FORMAT, "capability": capability_key(), "entries": []}
    for stem, entry in entries.items():
        digests = {name: _sha256((cache / name).read_bytes()) for name in entry["files"]}
        manifest["entries"].append({"stem": stem, "profile": entry["profile"], "key": entry["key"], "files": digests})
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(temporary, "w", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            for entry in manifest["entries"]:
                for name in entry["files"]:
                    _add(tar, PACKAGES + name, (cache / name).read_bytes())
        os.chmod(temporary, 0o644)
        os.replace(temporary, destination)
    finally:
        temporary.unlink(missing_ok=True)
    return manifest


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


@contextmanager
def _open_safely(bundle: Path) -> Iterator[IO[bytes]]:
    """The bundle opened for reading once it passes the strict modes, checked again by its descriptor."""
    try:
        check_file(bundle, "bundle")
        handle = os.open(os.path.realpath(bundle), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (UnsafePath, OSError) as exc:
        raise BundleError(str(exc)) from exc
    with os.fdopen(handle, "rb") as stream:
        try:
            check_stat(bundle, os.fstat(handle), "bundle")
        except UnsafePath as exc:
            raise BundleError(str(exc)) from exc
        yield stream


def read_bundle(bundle: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and every package file of a bundle, each checked against the manifest; BundleError if any is
    not what the manifest says (nothing is written anywhere by this)."""
    files: dict[str, bytes] = {}
    manifest_bytes: bytes | None = None
    with _open_safely(bundle) as stream:
        try:
            with tarfile.open(fileobj=stream, mode="r:") as tar:
                for member in tar:
                    data = _member_bytes(tar, member)
                    if member.name == MANIFEST:
                        manifest_bytes = data
                    else:
                        files[member.name.removeprefix(PACKAGES)] = data
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(f"{bundle} is not a readable bundle (corrupted?): {exc}") from exc
    if manifest_bytes is None:
        raise BundleError(f"{bundle} has no {MANIFEST}")
    manifest = _parse_manifest(manifest_bytes)
    _check_files(manifest, files)
    return manifest, files


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """A member's bytes when it is a plain file named `manifest.json` or `packages/<plain name>`."""
    name = member.name
    if not member.isreg():
        kind = "a symbolic link" if member.issym() else "a hard link" if member.islnk() else "not a regular file"
        raise BundleError(f"bundle member {name!r} is {kind}: refused")
    leaf = name.removeprefix(PACKAGES)
    plain = leaf and "/" not in leaf and leaf not in (".", "..") and not leaf.startswith(".") and "\0" not in leaf
    if name != MANIFEST and not (name.startswith(PACKAGES) and plain):
        raise BundleError(f"bundle member {name!r} is outside packages/ or not a plain file name: refused")
    extracted = tar.extractfile(member)
    if extracted is None:
        raise BundleError(f"bundle member {name!r} cannot be read")
    return extracted.read()


def _parse_manifest(data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise BundleError(f"{MANIFEST} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{MANIFEST} is not a bundle manifest of format {BUNDLE_FORMAT}")
    entries = manifest.get("entries")
    if not isinstance(entries, list) or not isinstance(manifest.get("capability"), dict):
        raise BundleError(f"{MANIFEST} has no capability or entries")
    for entry in entries:
        ok = isinstance(entry, dict) and isinstance(entry.get("key"), dict) and isinstance(entry.get("files"), dict)
        if not ok or entry.get("stem") != stem_for(str(entry.get("profile")), entry["key"]):
            raise BundleError(f"{MANIFEST}: entry {entry.get('stem') if isinstance(entry, dict) else entry!r} does "
                              "not name its own key (stem differs from the key's sha256)")  # fmt: skip
    return manifest


def _check_files(manifest: dict[str, Any], files: dict[str, bytes]) -> None:
    """Every file of the manifest present with its sha256, no file the manifest does not list, each key file the
    entry's key and each stored `.sha256` the digest of its package."""
    listed: dict[str, str] = {}
    for entry in manifest["entries"]:
        for name, digest in entry["files"].items():
            if not str(name).startswith(entry["stem"]) or name in listed:
                raise BundleError(f"{MANIFEST}: {name!r} does not belong to entry {entry['stem']}")
            listed[str(name)] = str(digest)
    extra = sorted(files.keys() - listed.keys())
    missing = sorted(listed.keys() - files.keys())
    if extra or missing:
        raise BundleError(f"bundle members and {MANIFEST} differ: not listed {extra}, missing {missing}")
    for name, digest in listed.items():
        actual = _sha256(files[name])
        if actual != digest:
            raise BundleError(f"{name}: sha256 {actual[:16]}... differs from {digest[:16]}... in {MANIFEST}")
    for entry in manifest["entries"]:
        stem = entry["stem"]
        if json.loads(files.get(f"{stem}.json", b"null")) != entry["key"]:
            raise BundleError(f"{stem}.json differs from the key {MANIFEST} gives for it")
        for package, stored in ((f"{stem}.pt2", f"{stem}.sha256"), (f"{stem}.xml", f"{stem}.sha256"),
                                (f"{stem}.bin", f"{stem}.bin.sha256")):  # fmt: skip
            if package in files and (stored not in files or _digest_text(files[stored]) != _sha256(files[package])):
                raise BundleError(f"{stored} does not hold the sha256 of {package}")


def _digest_text(data: bytes) -> str:
    words = data.decode("ascii", "replace").split()
    return words[0] if words else ""


def mismatch(key: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why a package of `key` would not run on a box of capability `here`, or None."""
    fields = [*CAPABILITY_FIELDS, *(("openvino",) if "openvino" in key.get("options", {}) else ())]
    for name in fields:
        theirs = key.get("options", {}).get(name) if name == "openvino" else key.get(name)
        if theirs != here.get(name):
            return f"built for {name} {theirs!r}; this box has {here.get(name)!r}"
    return None


def import_bundle(bundle: Path, cache: Path, here: dict[str, Any] | None = None) -> ImportOutcome:
    """Verify `bundle` whole, then install into `cache` each entry built for this box's capability key."""
    manifest, files = read_bundle(bundle)
    here = capability_key() if here is None else here
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_tree(cache, f"cache_dir {cache}")
    except (UnsafePath, OSError) as exc:
        raise BundleError(str(exc)) from exc
    outcome = ImportOutcome()
    for entry in manifest["entries"]:
        stem = entry["stem"]
        why = mismatch(entry["key"], here)
        if why is not None:
            outcome.refused[stem] = why
            continue
        names = sorted(entry["files"], key=_install_order)
        if all((cache / n).is_file() and _sha256((cache / n).read_bytes()) == entry["files"][n] for n in names):
            outcome.present.append(stem)
            continue
        with _entry_lock(cache, stem):
            for name in names:
                _install(cache / name, files[name])
        outcome.installed.append(stem)
    return outcome


def _install_order(name: str) -> int:
    """Keys and digests first, the weights next, what a worker looks for (.pt2, .xml) last."""
    return 2 if name.endswith((".pt2", ".xml")) else 1 if name.endswith(".bin") else 0


@contextmanager
def _entry_lock(cache: Path, stem: str) -> Iterator[None]:
    """The entry's lock, as the workers take it: none of them reads or builds the entry meanwhile."""
    with open(cache / f"{stem}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install(path: Path, data: bytes) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.import.tmp")
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
