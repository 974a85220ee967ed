"""On-disk cache of compiled model artifacts, so a restarted worker loads instead of compiling.

An entry's key covers everything the compiled code depends on: the model (weights and where its
code came from), the input spec, the profile and its options, the calibration set, the torch
version and the CPU capability torch dispatches to. Workers of one model start together, so a
per-key lock makes one of them compile while the others wait and then load its result.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from protocol.launch import ModelSource
from protocol.tensors import TensorSpec

_CHUNK = 1 << 20
#: How long a failed build is answered from its marker before a worker tries to compile it again.
FAILED_RETRY_S = 3600.0


class CachedBuildFailure(Exception):
    """This key's build failed recently; the message is that failure's."""


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
    """sha256 of one file (a calibration set)."""
    digest = hashlib.sha256()
    _hash_file(digest, path)
    return digest.hexdigest()


#: Bumped whenever how infervisor exports, quantizes or compiles changes: old packages are then not reused.
CACHE_FORMAT = 2


def _cpu_flags_digest() -> str:
    """The full flag list of this CPU: inductor compiles for the exact machine (-march=native), not a tier."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.partition(":")[2] for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]


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
        "cpu_flags": _cpu_flags_digest(),
    }


class LockWatcher(Protocol):
    """Told when a key's lock is held by another process, and when this one got it after waiting."""

    def waiting(self) -> None:
        """Another process holds the lock: this one waits for its build."""

    def resumed(self) -> None:
        """This process holds the lock now, after waiting."""


class ArtifactCache:
    """A directory of compiled packages named by the sha256 of their key, written atomically."""

    def __init__(self, root: Path, watcher: LockWatcher | None = None) -> None:
        self.root = root
        #: A worker's progress: a wait for a sibling's compile is its own phase (its time is not this build's).
        self.watcher = watcher
        #: Builds this process ran (cache misses, failed ones too): a worker that ran one restarts itself
        #: from the cache so the compiler's memory does not stay for its life (worker/reexec.py).
        self.builds = 0

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
        """Make sure `path` holds the artifact (building it into a temp file first); True on a cache hit.

        A build that failed is remembered for FAILED_RETRY_S: the siblings waiting on the lock, and
        workers respawned meanwhile, get its error at once instead of each paying the compile again.
        """
        with self.locked(path):
            if path.exists():
                return True
            failed = path.with_suffix(".failed")
            if failed.exists() and time.time() - failed.stat().st_mtime < FAILED_RETRY_S:
                raise CachedBuildFailure(f"{failed.read_text()[:400]} (remembered in {failed.name})")
            self._sweep(path.stem)
            self.builds += 1
            handle, temporary = tempfile.mkstemp(dir=self.root, prefix=path.stem, suffix=".tmp.pt2")
            os.close(handle)
            try:
                build(Path(temporary))
                # A crash mid-write leaves only a .tmp file; readers only ever see complete packages.
                os.replace(temporary, path)
            except Exception as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
            failed.unlink(missing_ok=True)
            path.with_suffix(".json").write_text(json.dumps(key, indent=1, sort_keys=True))
            return False

    def _sweep(self, stem: str) -> None:
        """Remove temp files a killed build of this key left behind (we hold its lock, so none is in use)."""
        for leftover in self.root.glob(f"{stem}*.tmp.pt2"):
            leftover.unlink(missing_ok=True)
