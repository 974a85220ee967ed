"""Hot reload through a Kubernetes ConfigMap volume: the kubelet swaps a `..data` symlink, never the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.supervisor.host.file_watch import DEBOUNCE_S, FileWatcher, link_folders
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for


class ConfigMapVolume:
    """A folder laid out and updated exactly as the kubelet's atomic writer does for a ConfigMap volume.

    config.json -> ..data/config.json, ..data -> ..<timestamp>/; an update writes a new timestamped
    folder, points ..data_tmp at it, renames ..data_tmp over ..data and then deletes the old folder.
    """

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        self.generation = 0
        root.mkdir()
        (root / "..data").symlink_to(self._write_generation(text))
        (root / "config.json").symlink_to("..data/config.json")

    @property
    def config_path(self) -> Path:
        """The path a pod's container is given: the symlink at the top of the mount."""
        return self.root / "config.json"

    def _write_generation(self, text: str) -> str:
        self.generation += 1
        folder = f"..2026_12_01_10_00_00.{self.generation:09d}"
        (self.root / folder).mkdir(mode=0o755)
        (self.root / folder / "config.json").write_text(text)
        return folder

    def update(self, text: str) -> None:
        """Publish new content the kubelet's way: the old file is never written, only unlinked at the end."""
        old = os.readlink(self.root / "..data")
        folder = self._write_generation(text)
        (self.root / "..data_tmp").symlink_to(folder)
        os.rename(self.root / "..data_tmp", self.root / "..data")
        shutil.rmtree(self.root / old)


class MountedDaemon(Daemon):
    """`infervisor serve` started like conftest's Daemon, but with --config on a ConfigMap-style mount."""

    def __init__(self, tmp: Path, volume: ConfigMapVolume) -> None:
        self.tmp = tmp
        self.runtime_dir = tmp / "run"
        self.config_path = volume.config_path
        self.log_path = tmp / "daemon.log"
        self._log = self.log_path.open("wb")
        command = [sys.executable, "-m", "infervisor", "serve", "--config", str(self.config_path)]
        self.process = subprocess.Popen(
            [*command, "--runtime-dir", str(self.runtime_dir)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ),
        )  # fmt: skip
        self.endpoint = f"ipc://{self.runtime_dir / CLIENT_SOCKET_NAME}"


def _config(tmp: Path, queue_size: int) -> str:
    models = {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, queue_size=queue_size)}
    return json.dumps({"cache_dir": str(tmp / "cache"), "models": models}, indent=2)


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[ConfigMapVolume, MountedDaemon]]:
    """A ConfigMap-style volume with a tiny model and a daemon serving from it, stopped at teardown."""
    volume = ConfigMapVolume(tmp_path / "etc-infervisor", _config(tmp_path, queue_size=8))
    daemon = MountedDaemon(tmp_path, volume)
    try:
        yield volume, daemon
    finally:
        daemon.stop()


def test_link_folders_of_a_configmap_mount_are_the_mount_and_the_current_generation(tmp_path: Path) -> None:
    """Both links (config.json and ..data) live in the mount; the file lives in the timestamped folder."""
    volume = ConfigMapVolume(tmp_path / "mount", "{}")
    current = os.readlink(volume.root / "..data")
    assert link_folders(str(volume.config_path)) == {str(volume.root), str(volume.root / current)}


def test_watcher_sees_a_data_symlink_swap_and_keeps_seeing_the_next_ones(tmp_path: Path) -> None:
    """Each kubelet-style swap is reported once under the config's key, the second one after a re-arm too."""
    volume = ConfigMapVolume(tmp_path / "mount", "{}")
    woken = threading.Event()
    watcher = FileWatcher(woken.set)
    watcher.watch({"config": volume.config_path})
    watcher.start()
    try:
        for text in ('{"a": 1}', '{"a": 2}'):
            woken.clear()
            volume.update(text)
            assert woken.wait(10), "no event reached the watcher"
            due: set[str] = wait_for(lambda: watcher.due(float("inf")), 10, "the swap reported as due")
            assert due == {"config"}
            assert volume.config_path.read_text() == text
        woken.clear()
        assert not woken.wait(DEBOUNCE_S * 2) and watcher.due(float("inf")) == set(), "a read is not a change"
    finally:
        watcher.stop()


def _queue_size(daemon: Daemon) -> int:
    size: int = daemon.status()["models"]["tiny"]["queue_size"]
    return size


def test_daemon_reloads_on_a_configmap_update_and_a_broken_one_changes_nothing(
    mounted: tuple[ConfigMapVolume, MountedDaemon], tmp_path: Path
) -> None:
    """A swapped-in ConfigMap is applied live; invalid JSON swapped in is reported and changes nothing."""
    volume, daemon = mounted
    status = daemon.wait_ready()
    first_digest = status["config"]["digest"]
    pid = status["models"]["tiny"]["workers"][0]["pid"]
    assert status["config"]["path"] == str(volume.config_path) and _queue_size(daemon) == 8

    volume.update(_config(tmp_path, queue_size=32))
    wait_for(lambda: _queue_size(daemon) == 32, 30, "queue_size applied live from the new ConfigMap")
    applied: dict[str, Any] = daemon.status()["config"]
    assert applied["digest"] != first_digest and applied["last_error"] is None
    assert applied["last_diff"]["model_live"] == {"tiny": ["queue_size"]}

    volume.update('{"models": {"tiny": ')
    wait_for(lambda: daemon.status()["config"]["last_error"], 30, "broken ConfigMap reported")
    status = daemon.status()
    assert status["config"]["last_error"][0].startswith("(file): not valid JSON")
    assert status["config"]["digest"] == applied["digest"] and _queue_size(daemon) == 32
    assert status["models"]["tiny"]["workers"][0]["pid"] == pid
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)

    # The rejected swap left the watcher on the new generation: the fix after it is picked up too.
    volume.update(_config(tmp_path, queue_size=16))
    wait_for(lambda: _queue_size(daemon) == 16, 30, "the fixed ConfigMap applied")
    assert daemon.status()["config"]["last_error"] is None
    events = [e["event"] for e in daemon.log_events()]
    assert events.count("config_applied") == 2 and events.count("config_rejected") == 1
