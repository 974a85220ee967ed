"""A cache a fleet can share: what one box built, as a signed bundle that another box verifies and installs.

A bundle is an uncompressed tar in one canonical shape (toolkit/bundle_tar.py): `manifest.json` first, its
ed25519 signature `manifest.sig` next (toolkit/bundle_keys.py), then `packages/<file>` for every file of every
package entry and `records/<file>` for each record (a fastest pick). The manifest holds the capability key of
the box that built it (torch's CPU capability, the CPU's full flag digest, the torch, torchao and openvino
versions), per entry its profile, its cache key and the sha256 and size of each of its files, the records'
names, sha256 and sizes, and the build's refusals (which profile of which model did not build, and why).

Importing checks the signature against the trusted keys before any member is read, then streams each member
to a staging folder inside the cache, checking its size (declared, then read) and sha256 against the signed
manifest; only when every member is what the manifest says are the entries built for this box renamed into
the cache, each under its lock, the package last. Anything else refuses the whole bundle, installing nothing:
a member the manifest does not list, a file name that is not an entry's known suffix (a `.failed` marker
never travels as a file: refusals travel only in the signed manifest), a manifest over its size or depth.
Entries built for another capability key are refused one by one, with the field that differs.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from infervisor.common.cpuinfo import cpu_flags_digest
from infervisor.common.processes import pid_alive
from infervisor.common.strict_modes import UnsafePath, check_file, check_stat, check_tree
from infervisor.supervisor.toolkit import bundle_keys
from infervisor.supervisor.toolkit.bundle_manifest import (
    ENTRY_SUFFIXES,
    MANIFEST,
    PACKAGES,
    RECORDS,
    file_sha256,
    is_record,
    parse_manifest,
    stem_for,
)
from infervisor.supervisor.toolkit.bundle_tar import BundleError, CanonicalReader, CanonicalWriter, Member

#: The manifest's own version: a bundle of another layout is refused (2: signed, sizes, records, refusals).
BUNDLE_FORMAT = 2
#: The largest manifest read (its size is checked in its header, before a byte of it is read).
MAX_MANIFEST_BYTES = 4 << 20
#: The largest member: an AOTInductor package of a large model is a few GB.
MAX_MEMBER_BYTES = 8 << 30
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

__all__ = ["BundleError", "ImportOutcome", "capability_key", "export_bundle", "import_bundle", "stem_for"]


@dataclass
class ImportOutcome:
    """What an import did: who signed it, entries installed, already present, refused (stem: reason), records
    installed, and the refusals the build recorded (shown, never installed as markers)."""

    signer: str = ""
    installed: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    records: list[str] = field(default_factory=list)
    records_refused: str | None = None
    build_refusals: list[dict[str, str]] = field(default_factory=list)


def capability_key() -> dict[str, Any]:
    """This box's capability key: what a package's key must hold to run here."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise BundleError(f"cannot read this box's capability key (torch): {done.stderr.strip()[-300:]}")
    key: dict[str, Any] = json.loads(done.stdout)
    key["cpu_flags"] = cpu_flags_digest()
    return key


def cache_entries(cache: Path) -> dict[str, dict[str, Any]]:
    """Each complete package entry of the cache by stem: its key (its `.json`) and the files that make it."""
    entries: dict[str, dict[str, Any]] = {}
    for key_file in sorted(cache.glob("*.json")):
        stem = key_file.name.removesuffix(".json")
        if stem.endswith(".buckets") or is_record(key_file.name):
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


def _described(path: Path) -> dict[str, Any]:
    return {"sha256": file_sha256(path), "size": path.stat().st_size}


def export_bundle(
    cache: Path,
    destination: Path,
    refusals: list[dict[str, str]] | None = None,
    signing_key: Ed25519PrivateKey | None = None,
    here: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the cache's package entries, its records and the build's `refusals` to `destination` (a temp file
    renamed into place), signed with `signing_key` when given; the manifest. `here`: this box's capability key
    when the caller has it."""
    try:
        check_tree(cache, f"cache_dir {cache}")
    except UnsafePath as exc:
        raise BundleError(str(exc)) from exc
    entries = cache_entries(cache)
    records = sorted(p.name for p in cache.iterdir() if is_record(p.name) and p.is_file()) if cache.is_dir() else []
    if not entries and not records and not refusals:
        raise BundleError(f"{cache} holds no compiled package, no pick and no refusal to export")
    manifest: dict[str, Any] = {"format": BUNDLE_FORMAT, "capability": here or capability_key(), "entries": [],
                                "records": [], "refusals": list(refusals or [])}  # fmt: skip
    for stem, entry in entries.items():
        files = {name: _described(cache / name) for name in entry["files"]}
        manifest["entries"].append({"stem": stem, "profile": entry["profile"], "key": entry["key"], "files": files})
    manifest["records"] = [{"name": name, **_described(cache / name)} for name in records]
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as stream:
            tar = CanonicalWriter(stream)
            tar.add_bytes(MANIFEST, text)
            if signing_key is not None:
                tar.add_bytes(bundle_keys.SIGNATURE, bundle_keys.sign(text, signing_key))
            for entry in manifest["entries"]:
                for name in entry["files"]:
                    tar.add_file(PACKAGES + name, cache / name)
            for record in manifest["records"]:
                tar.add_file(RECORDS + record["name"], cache / record["name"])
            tar.close()
        os.chmod(temporary, 0o644)
        os.replace(temporary, destination)
    finally:
        temporary.unlink(missing_ok=True)
    return manifest


@contextmanager
def _open_safely(bundle: Path) -> Iterator[tuple[IO[bytes], int]]:
    """The bundle opened for reading once it passes the strict modes, checked again by its descriptor; its size."""
    try:
        check_file(bundle, "bundle")
        handle = os.open(os.path.realpath(bundle), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (UnsafePath, OSError) as exc:
        raise BundleError(str(exc)) from exc
    with os.fdopen(handle, "rb") as stream:
        info = os.fstat(handle)
        try:
            check_stat(bundle, info, "bundle")
        except UnsafePath as exc:
            raise BundleError(str(exc)) from exc
        yield stream, info.st_size


@dataclass
class _Staged:
    """A verified bundle whose members wait in `folder` (inside the cache) to be renamed into place."""

    manifest: dict[str, Any]
    signer: str
    folder: Path


def _read_signed_manifest(reader: CanonicalReader, trusted: dict[str, Any], allow_unsigned: bool) -> tuple[
        dict[str, Any], str, Member | None]:  # fmt: skip
    """The manifest once its signature checks out, who signed it, and the first member after them."""
    first = reader.next_member(MAX_MEMBER_BYTES)
    if first is None or first.name != MANIFEST:
        raise BundleError(f"the bundle does not start with {MANIFEST}")
    if first.size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{MANIFEST} is {first.size:,} bytes, over the {MAX_MANIFEST_BYTES:,}-byte cap: refused")
    text = reader.read_all(first)
    signature: bytes | None = None
    after = reader.next_member(MAX_MEMBER_BYTES)
    if after is not None and after.name == bundle_keys.SIGNATURE:
        if after.size > bundle_keys.MAX_SIGNATURE_BYTES:
            raise BundleError(f"{bundle_keys.SIGNATURE} is {after.size:,} bytes: not a signature")
        signature = reader.read_all(after)
        after = reader.next_member(MAX_MEMBER_BYTES)
    signer = bundle_keys.verify(text, signature, trusted, allow_unsigned)
    return parse_manifest(text, BUNDLE_FORMAT), signer, after


def _stage(bundle: Path, cache: Path, trusted: dict[str, Any], allow_unsigned: bool) -> _Staged:
    """Verify the signature, then stream every member into a fresh staging folder of the cache, each checked
    against the manifest; BundleError (the folder removed) at the first thing that is not what it says."""
    with _open_safely(bundle) as (stream, length):
        reader = CanonicalReader(stream, length)
        manifest, signer, member = _read_signed_manifest(reader, trusted, allow_unsigned)
        expected: dict[str, dict[str, Any]] = dict(manifest["members"])
        folder = cache / f".import-{os.getpid()}-{secrets.token_hex(4)}"
        folder.mkdir(mode=0o700)
        try:
            while member is not None:
                want = expected.pop(member.name, None)
                if want is None:
                    raise BundleError(f"bundle member {member.name!r} is not listed in {MANIFEST} (or is there "
                                      "twice): refused")  # fmt: skip
                if member.size != want["size"]:
                    raise BundleError(f"{member.name}: {member.size:,} bytes, but {MANIFEST} says {want['size']:,}")
                handle = os.open(folder / Path(member.name).name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    digest = reader.copy_to(member, handle)
                    os.fsync(handle)
                finally:
                    os.close(handle)
                if digest != want["sha256"]:
                    raise BundleError(f"{member.name}: sha256 {digest[:16]}... differs from {want['sha256'][:16]}... "
                                      f"in {MANIFEST}")  # fmt: skip
                member = reader.next_member(MAX_MEMBER_BYTES)
            if expected:
                raise BundleError(f"bundle members and {MANIFEST} differ: missing {sorted(expected)}")
            _check_entry_files(manifest, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    return _Staged(manifest, signer, folder)


def _check_entry_files(manifest: dict[str, Any], folder: Path) -> None:
    """Each key file the entry's key, each stored `.sha256` the digest of its package."""
    for entry in manifest["entries"]:
        stem = entry["stem"]
        try:
            key = json.loads((folder / f"{stem}.json").read_bytes())
        except (OSError, ValueError, RecursionError):
            key = None
        if key != entry["key"]:
            raise BundleError(f"{stem}.json differs from the key {MANIFEST} gives for it")
        for package, stored in ((f"{stem}.pt2", f"{stem}.sha256"), (f"{stem}.xml", f"{stem}.sha256"),
                                (f"{stem}.bin", f"{stem}.bin.sha256")):  # fmt: skip
            if package not in entry["files"]:
                continue
            words = (folder / stored).read_bytes()[:200].decode("ascii", "replace").split() if stored in entry[
                "files"] else []  # fmt: skip
            if not words or words[0] != entry["files"][package]["sha256"]:
                raise BundleError(f"{stored} does not hold the sha256 of {package}")


def mismatch(key: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why a package of `key` would not run on a box of capability `here`, or None."""
    fields = [*CAPABILITY_FIELDS, *(("openvino",) if "openvino" in key.get("options", {}) else ())]
    for name in fields:
        theirs = key.get("options", {}).get(name) if name == "openvino" else key.get(name)
        if theirs != here.get(name):
            return f"built for {name} {theirs!r}; this box has {here.get(name)!r}"
    return None


def import_bundle(
    bundle: Path,
    cache: Path,
    here: dict[str, Any] | None = None,
    trusted_keys: tuple[str, ...] = (),
    allow_unsigned: bool = False,
) -> ImportOutcome:
    """Verify `bundle` whole (signed by one of `trusted_keys` unless `allow_unsigned`), then install into `cache`
    each entry built for this box's capability key, and the records when the whole bundle was built for it."""
    trusted = bundle_keys.load_trusted_keys(trusted_keys)
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_tree(cache, f"cache_dir {cache}")
    except (UnsafePath, OSError) as exc:
        raise BundleError(str(exc)) from exc
    _sweep_staging(cache)
    staged = _stage(bundle, cache, trusted, allow_unsigned)
    try:
        return _install_staged(staged, cache, capability_key() if here is None else here)
    finally:
        shutil.rmtree(staged.folder, ignore_errors=True)


def _sweep_staging(cache: Path) -> None:
    """Remove the staging folders an import killed midway left (its pid gone): never installed, only in the way."""
    for folder in cache.glob(".import-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _install_staged(staged: _Staged, cache: Path, here: dict[str, Any]) -> ImportOutcome:
    manifest = staged.manifest
    outcome = ImportOutcome(signer=staged.signer, build_refusals=list(manifest["refusals"]))
    for entry in manifest["entries"]:
        stem = entry["stem"]
        why = mismatch(entry["key"], here)
        if why is not None:
            outcome.refused[stem] = why
            continue
        names = sorted(entry["files"], key=_install_order)
        if all((cache / n).is_file() and file_sha256(cache / n) == entry["files"][n]["sha256"] for n in names):
            outcome.present.append(stem)
            continue
        with _entry_lock(cache, stem):
            for name in names:
                _install(staged.folder / name, cache / name)
        outcome.installed.append(stem)
    whole = mismatch(manifest["capability"], here)
    for record in manifest["records"]:
        if whole is not None:
            outcome.records_refused = whole
            break
        _install(staged.folder / record["name"], cache / record["name"])
        outcome.records.append(record["name"])
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


def _install(staged: Path, path: Path) -> None:
    """Rename a verified staged file (already synced) into place, then sync the folder."""
    os.replace(staged, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
