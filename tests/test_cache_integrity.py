"""A cached package is what was built: checked against its stored sha256, moved aside and rebuilt when it is not."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.worker.models import build_builtin
from infervisor.worker.profiles.cache import (
    ArtifactCache,
    CachedBuildFailure,
    NoSpaceLeft,
    no_space_left,
)
from infervisor.worker.profiles.covered_export import ExportError
from tests.conftest import STATIC_TINY_INPUTS, Daemon, model_entry, wait_for


def _flip(path: Path, spans: int = 3, width: int = 64) -> None:
    """Invert `spans` runs of `width` bytes spread through the file, as a failing SD card does."""
    data = bytearray(path.read_bytes())
    for index in range(1, spans + 1):
        start = len(data) * index // (spans + 1)
        data[start : start + width] = bytes(b ^ 0xFF for b in data[start : start + width])
    path.write_bytes(bytes(data))


def _loader(path: Path) -> bytes:
    """A stand-in package loader: a package is valid when it starts with b"package"."""
    data = path.read_bytes()
    if not data.startswith(b"package"):
        raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
    return data


def test_a_package_that_fails_its_digest_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    """Flipped bytes, a missing digest and a package that does not load each cost one rebuild, with the reason."""
    cache = ArtifactCache(tmp_path)
    key = {"k": 1}
    path = cache.path_for("aoti", key)
    builds: list[Path] = []

    def build(target: Path) -> None:
        builds.append(target)
        target.write_bytes(b"package" + bytes(300))

    first = cache.fetch(path, key, build, _loader)
    assert not first.hit and first.rejected is None and len(builds) == 1
    stored = path.with_suffix(".sha256").read_text().split()
    assert stored == [hashlib.sha256(path.read_bytes()).hexdigest(), path.name]
    assert cache.fetch(path, key, build, _loader).hit and len(builds) == 1

    _flip(path, spans=1, width=8)
    flipped = cache.fetch(path, key, build, _loader)
    assert not flipped.hit and "sha256" in (flipped.rejected or "") and len(builds) == 2
    assert flipped.value == b"package" + bytes(300)
    assert path.with_name(path.name + ".corrupt").exists()

    path.with_suffix(".sha256").unlink()
    unverifiable = cache.fetch(path, key, build, _loader)
    assert "no stored sha256" in (unverifiable.rejected or "") and len(builds) == 3

    # Damaged before its digest was taken: only the load can tell, and it is rebuilt all the same.
    path.write_bytes(b"garbage")
    path.with_suffix(".sha256").write_text(f"{hashlib.sha256(b'garbage').hexdigest()}  {path.name}\n")
    unloadable = cache.fetch(path, key, build, _loader)
    assert "does not load (RuntimeError: PytorchStreamReader" in (unloadable.rejected or "") and len(builds) == 4
    assert path.with_name(path.name + ".corrupt").read_bytes() == b"garbage"


def test_a_fresh_package_that_does_not_load_is_remembered_as_a_failed_build(tmp_path: Path) -> None:
    """A build whose output does not load fails once; siblings get the remembered failure, not another compile."""
    cache = ArtifactCache(tmp_path)
    key = {"k": 2}
    path = cache.path_for("aoti", key)
    builds: list[Path] = []

    def broken(target: Path) -> None:
        builds.append(target)
        target.write_bytes(b"not a package")

    with pytest.raises(RuntimeError, match="central directory"):
        cache.fetch(path, key, broken, _loader)
    with pytest.raises(CachedBuildFailure, match="central directory"):
        cache.fetch(path, key, broken, _loader)
    assert len(builds) == 1 and not path.exists()


def test_enospc_anywhere_in_a_build_reads_no_space_left_on_device(tmp_path: Path) -> None:
    """errno 28 and a compiler's 'No space left on device' deep in its output both say so; neither is remembered."""
    cache = ArtifactCache(tmp_path)
    key = {"k": 3}
    path = cache.path_for("aoti", key)
    compiler = subprocess.CalledProcessError(
        1, ["g++"], output="x" * 2000 + "\nfatal error: error writing to /tmp/ccQ.s: No space left on device\n"
    )

    def cut_compiler_error(target: Path) -> None:
        try:
            raise compiler
        except subprocess.CalledProcessError as exc:
            raise ExportError(f"AOTInductor compile failed: CppCompileError: {str(exc)[:300]}") from exc

    def full_disk(target: Path) -> None:
        raise OSError(28, os.strerror(28), str(target))

    for build in (cut_compiler_error, full_disk):
        with pytest.raises(NoSpaceLeft, match="no space left on device while building"):
            cache.get_or_build(path, key, build)
        assert not path.with_suffix(".failed").exists()
    assert not no_space_left(RuntimeError("c++ compile failed"))


def test_a_build_on_a_full_disk_says_so(tmp_path: Path) -> None:
    """A real ENOSPC (a 64 kB tmpfs, 0700 as strict modes ask, as the cache) is reported as no space left on device."""
    mount = tmp_path / "small"
    mount.mkdir()
    options = "size=64k,mode=0700"
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        cache = ArtifactCache(mount)
        key = {"k": 4}
        with pytest.raises(NoSpaceLeft, match=r"no space left on device .* MB free"):
            cache.get_or_build(cache.path_for("aoti", key), key, lambda target: target.write_bytes(bytes(1 << 20)))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _aoti_entry(profiles: list[str]) -> dict[str, Any]:
    return model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS, outputs=["y"], profiles=profiles)


def _start_on_a_copy(
    start_daemon: Callable[..., Daemon], built: Path, into: Path, profiles: list[str]
) -> tuple[Daemon, Path]:
    """A daemon on its own copy (`into`) of the built cache: it loads the package at its first start."""
    cache = Path(shutil.copytree(built, into, symlinks=True))
    config = {"cache_dir": str(cache), "oversubscribe": True, "models": {"m": _aoti_entry(profiles)}}
    return start_daemon(config), cache


def _restart_and_wait(daemon: Daemon, old_pid: int) -> dict[str, Any]:
    assert daemon.control({"cmd": "restart", "model": "m"})["queued"] == 1

    def replaced() -> dict[str, Any] | None:
        serving = [w for w in daemon.status()["models"]["m"]["workers"] if w["state"] == "serving"]
        return serving[0] if serving and serving[0]["pid"] != old_pid else None

    worker: dict[str, Any] = wait_for(replaced, 300, "m restarted")
    return worker


def _served_like_eager(daemon: Daemon) -> None:
    x = np.random.default_rng(7).standard_normal((1, 16)).astype(np.float32)
    with torch.inference_mode():
        expected = build_builtin("tiny")(torch.from_numpy(x)).numpy()
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("m", {"x": x})["y"], expected, rtol=1e-4, atol=1e-5)


def test_a_cached_package_with_flipped_bytes_is_rebuilt_and_never_served(
    start_daemon: Callable[..., Daemon], built_tiny_aoti: Path, tmp_path: Path
) -> None:
    """3 x 64 flipped bytes fail the sha256 check: the package is moved aside, rebuilt, and replies match eager."""
    daemon, cache = _start_on_a_copy(start_daemon, built_tiny_aoti, tmp_path / "cache", ["aoti"])
    (first,) = daemon.wait_ready(timeout=300)["models"]["m"]["workers"]
    assert first["profile"] == "aoti", first
    assert any(note.startswith("loaded cached package aoti-") for note in first["profile_build"]), first
    (package,) = cache.glob("aoti-*.pt2")
    _flip(package)
    again = _restart_and_wait(daemon, first["pid"])
    assert again["profile"] == "aoti" and again["profile_skipped"] == [], again
    notes = " | ".join(again["profile_build"])
    assert f"cached package {package.name} sha256" in notes and "moved aside" in notes, notes
    # Rebuilt, then (the worker restarts after a build to drop its memory) loaded from the cache.
    assert "restarted the process after its build (1 cache miss" in notes, notes
    assert f"loaded cached package {package.name}" in notes, notes
    rejected = [e for e in daemon.log_events() if e.get("event") == "cached_package_rejected"]
    assert len(rejected) == 1 and "sha256" in rejected[0]["reason"], rejected
    assert package.with_name(package.name + ".corrupt").exists()
    assert hashlib.sha256(package.read_bytes()).hexdigest() == package.with_suffix(".sha256").read_text().split()[0]
    _served_like_eager(daemon)


def test_a_truncated_package_is_rebuilt_not_left_on_eager(
    start_daemon: Callable[..., Daemon], built_tiny_aoti: Path, tmp_path: Path
) -> None:
    """A package cut in half (its digest taken after the damage, so only the load sees it) is rebuilt and serves."""
    daemon, cache = _start_on_a_copy(start_daemon, built_tiny_aoti, tmp_path / "cache", ["aoti", "eager"])
    (first,) = daemon.wait_ready(timeout=300)["models"]["m"]["workers"]
    assert first["profile"] == "aoti", first
    assert any(note.startswith("loaded cached package aoti-") for note in first["profile_build"]), first
    (package,) = cache.glob("aoti-*.pt2")
    with package.open("r+b") as handle:
        handle.truncate(package.stat().st_size // 2)
    package.with_suffix(".sha256").write_text(f"{hashlib.sha256(package.read_bytes()).hexdigest()}  {package.name}\n")
    again = _restart_and_wait(daemon, first["pid"])
    assert again["profile"] == "aoti" and again["profile_skipped"] == [], again
    notes = " | ".join(again["profile_build"])
    assert "does not load" in notes and "restarted the process after its build (1 cache miss" in notes, notes
    assert any(e.get("event") == "cached_package_rejected" for e in daemon.log_events())
    _served_like_eager(daemon)


def test_a_worker_that_loads_a_package_leaves_no_unpacked_copy_behind(
    start_daemon: Callable[..., Daemon], built_tiny_aoti: Path, tmp_path: Path
) -> None:
    """torch unpacks a package under TMPDIR to load it: nothing of it stays there, even after a kill -9."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    cache = Path(shutil.copytree(built_tiny_aoti, tmp_path / "cache", symlinks=True))
    config = {"cache_dir": str(cache), "oversubscribe": True, "models": {"m": _aoti_entry(["aoti"])}}
    daemon = start_daemon(config, env={"TMPDIR": str(scratch)})
    (first,) = daemon.wait_ready(timeout=300)["models"]["m"]["workers"]
    assert any(note.startswith("loaded cached package aoti-") for note in first["profile_build"]), first
    os.kill(first["pid"], signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        serving = [w for w in daemon.status()["models"]["m"]["workers"] if w["state"] == "serving"]
        return serving[0] if serving and serving[0]["pid"] != first["pid"] else None

    again = wait_for(replaced, 300, "m serving again after the kill")
    assert again["profile"] == "aoti", again
    _served_like_eager(daemon)
    left = sorted(p.name for p in scratch.iterdir() if p.name.startswith(("aotinductor_", "infervisor-package-")))
    assert left == [], left
