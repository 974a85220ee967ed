"""On-disk cache of compiled model artifacts, so a restarted worker loads instead of compiling.

An entry's key covers everything the compiled code depends on: the model (weights and where its
code came from), the input spec, the profile and its options, the calibration set, the torch
version and the CPU capability torch dispatches to. Workers of one model start together, so a
per-key lock makes one of them compile while the others wait and then load its result.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from protocol.launch import ModelSource
from protocol.tensors import TensorSpec

_CHUNK = 1 << 20


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
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        # Flattened first: a 0-d buffer (BatchNorm's counter) cannot be viewed as bytes.
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of one file (a calibration set)."""
    digest = hashlib.sha256()
    _hash_file(digest, path)
    return digest.hexdigest()


def artifact_key(model: str, profile: str, specs: tuple[TensorSpec, ...], options: dict[str, Any]) -> dict[str, Any]:
    """What a compiled artifact depends on, as a JSON-able map (its sha256 names the file)."""
    return {
        "model": model,
        "profile": profile,
        "inputs": [[s.name, s.dtype, list(s.shape)] for s in specs],
        "options": options,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


class ArtifactCache:
    """A directory of compiled packages named by the sha256 of their key, written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, profile: str, key: dict[str, Any]) -> Path:
        """Where the artifact of this key lives."""
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.root / f"{profile}-{name}.pt2"

    @contextmanager
    def locked(self, path: Path) -> Iterator[None]:
        """Hold the key's lock: the sibling that gets it first compiles, the others wait for its file."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def get_or_build(self, path: Path, key: dict[str, Any], build: Callable[[Path], None]) -> bool:
        """Make sure `path` holds the artifact (building it into a temp file first); True on a cache hit."""
        with self.locked(path):
            if path.exists():
                return True
            handle, temporary = tempfile.mkstemp(dir=self.root, prefix=path.stem, suffix=".tmp.pt2")
            os.close(handle)
            try:
                build(Path(temporary))
                # A crash mid-write leaves only a .tmp file; readers only ever see complete packages.
                os.replace(temporary, path)
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
            path.with_suffix(".json").write_text(json.dumps(key, indent=1, sort_keys=True))
            return False
