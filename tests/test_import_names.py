"""Modules named like our subpackages, where the daemon starts or on its path, shadow nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY_INPUTS, Daemon, model_entry

#: What a user's application folder or another installed package may hold; each one refuses to be imported.
SHADOWS = ("common.py", "protocol.py", "worker.py", "supervisor/__init__.py")
REFUSE = 'raise ImportError("a module of the working directory or of supervisord was imported: " + __name__)\n'

FACTORY_MODULE = """
import torch


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def doubler() -> torch.nn.Module:
    return Doubler()
"""


def _plant(folder: Path, names: tuple[str, ...]) -> Path:
    """Write each module of `names` under `folder`, each raising on import."""
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(REFUSE)
    return folder


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Daemons a test starts by hand (with a working directory of its own), stopped at teardown."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.stop()


def test_a_daemon_among_shadowing_modules_serves_and_its_cli_answers(tmp_path: Path, daemons: list[Daemon]) -> None:
    """Started from a folder holding common.py, protocol.py, worker.py and supervisor/, with a `supervisor`
    package (standing in for supervisord's) first on PYTHONPATH, the daemon, its workers and its CLI work."""
    app = _plant(tmp_path / "app", SHADOWS)
    supervisord = _plant(tmp_path / "supervisord-site", ("supervisor/__init__.py",))
    python_path = os.pathsep.join([str(supervisord), os.environ["PYTHONPATH"]])
    (tmp_path / "d").mkdir()
    config = {"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=1)}}
    daemon = Daemon(tmp_path / "d", config, env={"PYTHONPATH": python_path}, cwd=app)
    daemons.append(daemon)
    daemon.wait_ready(timeout=120)
    with daemon.client() as client:
        y = client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, timeout=10.0)["y"]
    assert y.shape == (1, 16)
    status = subprocess.run(
        [sys.executable, "-m", "infervisor", "status", "--check", "--runtime-dir", str(daemon.runtime_dir)],
        cwd=app, env={**os.environ, "PYTHONPATH": python_path}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    assert "was imported" not in daemon.log_text() + status.stderr


def test_a_python_model_beside_config_json_is_found(tmp_path: Path, daemons: list[Daemon]) -> None:
    """A `{"python": "module:factory"}` source is looked up in the config's directory after PYTHONPATH."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "doubling_model.py").write_text(FACTORY_MODULE)
    entry = model_entry({"python": "doubling_model:doubler"}, TINY_INPUTS, workers=1, outputs=["y"])
    config = {"models": {"double": entry}}
    daemon = Daemon(folder, config, cwd=tmp_path)
    daemons.append(daemon)
    daemon.wait_ready(timeout=120)
    with daemon.client() as client:
        y = client.infer("double", {"x": np.full((1, 16), 3, np.float32)}, timeout=10.0)["y"]
    np.testing.assert_array_equal(y, np.full((1, 16), 6, np.float32))
