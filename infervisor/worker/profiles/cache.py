"""On-disk cache of compiled model artifacts, so a restarted worker loads instead of compiling.

An entry's key covers everything the compiled code depends on: the model (weights and where its
code came from), the input spec, the profile and its options, the calibration set, the torch
version and the CPU capability torch dispatches to. Workers of one model start together, so a
per-key lock makes one of them compile while the others wait and then load its result.

A package is what was built, or it is not served: its sha256 is stored beside it when it is built
(`<stem>.sha256`, in sha256sum's format) and checked on every load; a package that fails the check
or fails to load is moved aside (`<name>.corrupt`) and built again. Every write is fsynced, file
and directory, around its rename, so a power cut leaves the old file or the new one, never half.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import structlog
import torch

from infervisor.common.cpuinfo import cpu_flags_digest
from infervisor.common.strict_modes import UnsafePath, check_file, check_tree
from infervisor.common.text import clip
from infervisor.protocol.launch import ModelSource
from infervisor.protocol.tensors import TensorSpec

log = structlog.get_logger("worker")

_CHUNK = 1 << 20
#: How long a failed build is answered from its marker before a worker tries to compile it again.
FAILED_RETRY_S = 3600.0
#: Beside each package: the sha256 of its bytes, taken when it was built.
DIGEST_SUFFIX = ".sha256"
#: A package that failed its check or its load is kept under its name plus this, for a post-mortem.
CORRUPT_SUFFIX = ".corrupt"

T = TypeVar("T")


class CachedBuildFailure(Exception):
    """This key's build failed recently; the message is that failure's."""


class UntrustedCache(Exception):
    """The cache folder, or something in it, is owned or writable by another user: nothing is loaded from it."""


class NotBuiltYet(Exception):
    """A worker that serves first asked for a package the cache does not hold yet (or another process is building)."""


class NoSpaceLeft(Exception):
    """A build ran out of disk (ENOSPC somewhere in it, a C++ compiler's error text included)."""


def no_space_left(exc: BaseException) -> bool:
    """Whether ENOSPC is anywhere in the exception's chain: an OSError's errno, or the text a tool printed.

    A C++ compiler reports a full disk only in its output ("error writing to /tmp/cc.s: No space left
    on device"), which the wrapping errors cut, so the text of every link is read in full.
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno == errno.ENOSPC:
            return True
        texts = [str(link), *(str(getattr(link, name, "") or "") for name in ("output", "stderr", "stdout"))]
        if any("no space left on device" in text.lower() or "errno 28]" in text.lower() for text in texts):
            return True
        link = link.__cause__ or link.__context__
    return False


def _hash_file(digest: Any, path: Path) -> None:
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)


def model_digest(module: Any, source: ModelSource) -> str:
    """sha256 over the source, its code (file or class source) and every weight, in name order."""
    digest = hashlib.sha256(json.dumps([source.kind, source.name, source.path]).encode())
    if source.path:
        _hash_file(digest, Path(source.path))
    code_file = inspect.getsourcefile(type(module)) if not isinstance(module, torch.jit.ScriptModule) else None
    if code_file and source.kind in ("builtin", "python"):
        _hash_file(digest, Path(code_file))
    state = module.state_dict() if hasattr(module, "state_dict") else {}
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, torch.Tensor) or value.is_quantized or value.layout != torch.strided:
            # Packed params, dtypes, extra state: their repr is what identifies them (stable per torch version).
            digest.update(f"{name}:{value!r}".encode())
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        # Flattened first: a 0-d buffer (BatchNorm's counter) cannot be viewed as bytes.
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of one file (a calibration set, a package)."""
    digest = hashlib.sha256()
    _hash_file(digest, path)
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable: without it a power cut can undo the rename."""
    handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def write_durably(path: Path, text: str) -> None:
    """Write `text` to `path` through a synced temp file renamed into place, then sync the directory."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(path.parent)


#: Bumped whenever how infervisor exports, quantizes or compiles changes: old packages are then not reused.
CACHE_FORMAT = 2


def _torchao_version() -> str | None:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def artifact_key(model: str, profile: str, specs: tuple[TensorSpec, ...], options: dict[str, Any]) -> dict[str, Any]:
    """What a compiled artifact depends on, as a JSON-able map (its sha256 names the file).

    The full CPU flag list is part of it: a cache directory copied to another box (an image, NFS)
    never hands that box a package built for other flags, where it could die of SIGILL.
    """
    return {
        "format": CACHE_FORMAT,
        "model": model,
        "profile": profile,
        "inputs": [[s.name, s.dtype, list(s.shape)] for s in specs],
        "options": options,
        "torch": torch.__version__,
        "torchao": _torchao_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags_digest(),
    }


class LockWatcher(Protocol):
    """Told when a key's lock is held by another process, and when this one got it after waiting."""

    def waiting(self) -> None:
        """Another process holds the lock: this one waits for its build."""

    def resumed(self) -> None:
        """This process holds the lock now, after waiting."""


@dataclass(frozen=True)
class Fetched(Generic[T]):
    """A loaded package, whether it came from the cache, and why a cached copy was rejected (if one was)."""

    value: T
    hit: bool
    rejected: str | None = None


def _load_failure(exc: Exception) -> str:
    """Why a package did not load, on one line (a C++ loader's message can run to many)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"does not load ({type(exc).__name__}: {first})"


@dataclass(frozen=True)
class _Ensured:
    hit: bool
    rejected: str | None
    identity: tuple[int, int, int]


def _identity(path: Path) -> tuple[int, int, int]:
    """Which file sits at `path` (a sibling may have replaced it meanwhile)."""
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class ArtifactCache:
    """A directory of compiled packages named by the sha256 of their key, written atomically."""

    def __init__(self, root: Path, watcher: LockWatcher | None = None) -> None:
        self.root = root
        #: A worker's progress: a wait for a sibling's compile is its own phase (its time is not this build's).
        self.watcher = watcher
        #: Builds this process ran (cache misses, failed ones too): a worker that ran one restarts itself
        #: from the cache so the compiler's memory does not stay for its life (infervisor/worker/reexec.py).
        self.builds = 0
        #: Serve first (LaunchSpec.ready_only): never build and never wait for another process's build.
        self.ready_only = False
        #: Why the cache is refused (strict modes), once checked: "" when it is safe, None before the check.
        self._refused: str | None = None

    def trust(self) -> None:
        """UntrustedCache unless the cache folder, the folders above it and every file and folder in it are owned
        by us (or root) and writable by nobody else: a package planted there would run as the daemon's user.

        The whole tree is walked once per process; since no one else may write in it, nothing can be added later.
        """
        if self._refused is None:
            try:
                # Made first, then checked: a folder another user made at this path meanwhile is then refused.
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError:
                pass  # a read-only place: checked as it is, and each build says why it cannot write
            try:
                check_tree(self.root, f"cache_dir {self.root}")
                self._refused = ""
            except UnsafePath as exc:
                self._refused = str(exc)
                log.error("cache_refused", cache_dir=str(self.root), reason=self._refused)
        if self._refused:
            raise UntrustedCache(self._refused)

    def trusted(self) -> bool:
        """Whether the cache passes the strict modes (see `trust`)."""
        try:
            self.trust()
        except UntrustedCache:
            return False
        return True

    def read_trusted(self, path: Path) -> str:
        """The text of a file in the cache, once the cache and the file itself pass the strict modes."""
        self.trust()
        try:
            check_file(path, "cached file")
        except UnsafePath as exc:
            raise UntrustedCache(str(exc)) from exc
        return path.read_text()

    def path_for(self, profile: str, key: dict[str, Any]) -> Path:
        """Where the artifact of this key lives."""
        return self.root / f"{self.stem_for(profile, key)}.pt2"

    @staticmethod
    def stem_for(profile: str, key: dict[str, Any]) -> str:
        """`<profile>-<sha256 of the key>`: the name of everything kept for this key."""
        return f"{profile}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}"

    @contextmanager
    def locked(self, path: Path) -> Iterator[None]:
        """Hold the key's lock: the sibling that gets it first compiles, the others wait for its file."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path.with_suffix(".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self.watcher is not None:
                    self.watcher.waiting()
                fcntl.flock(lock, fcntl.LOCK_EX)
                if self.watcher is not None:
                    self.watcher.resumed()
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def get_or_build(self, path: Path, key: dict[str, Any], build: Callable[[Path], None]) -> bool:
        """Make sure `path` holds a verified artifact (building it into a temp file first); True on a cache hit.

        A build that failed is remembered for FAILED_RETRY_S: the siblings waiting on the lock, and
        workers respawned meanwhile, get its error at once instead of each paying the compile again.
        A cached package whose sha256 differs from the one stored at build time is moved aside and built again.
        """
        return self._ensure(path, key, build).hit

    def fetch(
        self, path: Path, key: dict[str, Any], build: Callable[[Path], None], load: Callable[[Path], T]
    ) -> Fetched[T]:
        """The loaded artifact of `path`: verified and loaded from the cache, else built, cached and loaded.

        A cached package that passes its check but does not load (written by a broken build, or a digest
        taken of a file already damaged) is moved aside and built once more. One just built that does not
        load is moved aside too and its failure remembered like a failed build.
        """
        ensured = self._ensure(path, key, build)
        try:
            return Fetched(load(path), ensured.hit, ensured.rejected)
        except Exception as exc:  # noqa: BLE001 - whatever a loader raises, the package is not served
            self._reject_loaded(path, ensured, exc)
            if not ensured.hit:
                raise
            reason = _load_failure(exc)
        again = self._ensure(path, key, build)
        try:
            return Fetched(load(path), again.hit, reason)
        except Exception as exc:
            self._reject_loaded(path, again, exc)
            raise

    def _reject_loaded(self, path: Path, ensured: _Ensured, exc: Exception) -> None:
        """Move aside a package that did not load (unless a sibling replaced it); remember a fresh one's failure."""
        with self.locked(path):
            if path.exists() and _identity(path) == ensured.identity:
                self._move_aside(path, _load_failure(exc))
            if not ensured.hit:
                self._remember_failure(path, f"{type(exc).__name__}: {exc}")

    def _ensure(self, path: Path, key: dict[str, Any], build: Callable[[Path], None]) -> _Ensured:
        self.trust()
        if self.ready_only:
            return self._ensure_built(path)
        with self.locked(path):
            rejected: str | None = None
            if path.exists():
                rejected = self._check(path)
                if rejected is None:
                    return _Ensured(True, None, _identity(path))
                self._move_aside(path, rejected)
            failed = path.with_suffix(".failed")
            if failed.exists() and time.time() - failed.stat().st_mtime < FAILED_RETRY_S:
                raise CachedBuildFailure(f"{clip(self.read_trusted(failed))} (remembered in {failed.name})")
            self._sweep(path.stem)
            self.builds += 1
            handle, temporary = tempfile.mkstemp(dir=self.root, prefix=path.stem, suffix=".tmp.pt2")
            os.close(handle)
            try:
                build(Path(temporary))
                self._install(Path(temporary), path)
            except Exception as exc:
                if no_space_left(exc):
                    # Not remembered: freeing space is the fix, and the next start should build at once.
                    free = shutil.disk_usage(self.root).free
                    raise NoSpaceLeft(
                        f"no space left on device while building {path.name} (cache {self.root}: "
                        f"{free // 1_000_000} MB free; the compiler's temp dir may be the full one)"
                    ) from exc
                self._remember_failure(path, f"{type(exc).__name__}: {exc}")
                raise
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
            path.with_suffix(".failed").unlink(missing_ok=True)
            write_durably(path.with_suffix(".json"), json.dumps(key, indent=1, sort_keys=True))
            return _Ensured(False, rejected, _identity(path))

    def _ensure_built(self, path: Path) -> _Ensured:
        """The verified package at `path` as it is now; NotBuiltYet when it is missing, damaged or being built."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path.with_suffix(".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise NotBuiltYet(f"{path.name} is being built by another process") from None
            try:
                if not path.exists():
                    raise NotBuiltYet(f"{path.name} is not built yet")
                rejected = self._check(path)
                if rejected is not None:
                    self._move_aside(path, rejected)
                    raise NotBuiltYet(f"{path.name} {rejected}: moved aside, to be built again")
                return _Ensured(True, None, _identity(path))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _install(self, temporary: Path, path: Path) -> None:
        """Sync the built file, store its digest, then rename it into place: readers see whole packages only."""
        _fsync_file(temporary)
        write_durably(path.with_suffix(DIGEST_SUFFIX), f"{file_digest(temporary)}  {path.name}\n")
        os.replace(temporary, path)
        _fsync_directory(path.parent)

    def _check(self, path: Path) -> str | None:
        """Why the package at `path` is not what was built, or None when its sha256 is the one stored.

        The package and its digest must pass the strict modes first (UntrustedCache): a digest beside a package
        catches bit rot, not a writer, so who may have written them is checked before what they say.
        """
        for each in (path, path.with_suffix(DIGEST_SUFFIX)):
            if each.exists():
                try:
                    check_file(each, "cached file")
                except UnsafePath as exc:
                    raise UntrustedCache(str(exc)) from exc
        try:
            stored = path.with_suffix(DIGEST_SUFFIX).read_text().split()[0]
        except (OSError, IndexError):
            return f"has no stored sha256 ({path.with_suffix(DIGEST_SUFFIX).name} is missing or empty)"
        actual = file_digest(path)
        if actual != stored:
            return f"sha256 {actual[:16]}... differs from {stored[:16]}... stored when it was built"
        return None

    def discard(self, path: Path, reason: str) -> None:
        """Move aside a cached artifact a caller found damaged (as `<name>.corrupt`), so the next fetch builds it."""
        with self.locked(path):
            if path.exists():
                self._move_aside(path, reason)

    def _move_aside(self, path: Path, reason: str) -> None:
        """Keep a rejected package as `<name>.corrupt` (the latest one only) and say so in the log."""
        aside = path.with_name(path.name + CORRUPT_SUFFIX)
        os.replace(path, aside)
        path.with_suffix(DIGEST_SUFFIX).unlink(missing_ok=True)
        _fsync_directory(path.parent)
        log.warning("cached_package_rejected", package=path.name, reason=reason, moved_to=aside.name)

    @staticmethod
    def _remember_failure(path: Path, text: str) -> None:
        try:
            write_durably(path.with_suffix(".failed"), text)
        except OSError as exc:  # a full or read-only disk: the failure is still reported, only not remembered
            log.warning("build_failure_not_remembered", package=path.name, error=str(exc))

    def _sweep(self, stem: str) -> None:
        """Remove temp files a killed build of this key left behind (we hold its lock, so none is in use)."""
        for leftover in self.root.glob(f"{stem}*.tmp.pt2"):
            leftover.unlink(missing_ok=True)
