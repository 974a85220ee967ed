"""The delivery path on a user's own model: optimize's daemon check on a python-source model beside its config, an
unproven verdict when that check cannot run, and report/doctor signing the config optimize wrote."""

from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from infervisor.supervisor.commands.optimize import EXIT_UNPROVEN
from tests.conftest import ROOT, wait_for

CLASSIFIER = '''"""A small Conv1d + Linear classifier: 4 channels x 16 samples in, 3 classes out."""

import sys

import torch


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, kernel_size=3, padding=1)
        self.head = torch.nn.Linear(8 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return Classifier().eval()


def measured_only() -> torch.nn.Module:
    """Loads in optimize's measuring children (infervisor.worker.bench), refuses in a daemon's worker."""
    if not sys.argv[0].endswith("bench.py"):
        raise RuntimeError("this model refuses to be served")
    return build()
'''
INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 4, 16]}]
#: Bounded measurements: one profile, one layout, a short sweep and a short check.
QUICK = ["--profiles", "eager", "--layouts", "1x1", "--seconds", "0.3", "--check-seconds", "1", "--timeout", "120"]


def _user_folder(tmp_path: Path, factory: str) -> Path:
    """A user's folder: classifier.py beside config.json, which names it as a python source; returns the config."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "classifier.py").write_text(CLASSIFIER)
    entry = {"source": {"python": f"classifier:{factory}"}, "inputs": INPUTS, "workers": 1, "cores_per_worker": 1}
    config = folder / "config.json"
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"clf": entry}}, indent=2))
    return config


def _infervisor(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infervisor", *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False, env=env,
    )  # fmt: skip


def _repeat(line: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a report's Repeat line in a shell where `infervisor` is this interpreter's (the line as printed)."""
    shell = f'infervisor() {{ "{sys.executable}" -m infervisor "$@"; }}\n{line}'
    return subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=300, check=False, env=env)


def _serve(config: Path, runtime_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "infervisor", "serve", "--config", str(config), "--runtime-dir", str(runtime_dir)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip


def _serving(runtime_dir: Path) -> bool:
    done = _infervisor("status", "--runtime-dir", str(runtime_dir), "--json", timeout=30)
    if done.returncode != 0:
        return False
    workers = json.loads(done.stdout)["models"]["clf"]["workers"]
    return bool(workers) and all(w["state"] == "serving" for w in workers)


def _repeat_lines(page: str) -> list[str]:
    return [html.unescape(part.split("</code>")[0]) for part in page.split("Repeat: <code>")[1:]]


def test_python_source_model_is_checked_served_probed_and_signed(tmp_path: Path) -> None:
    """optimize's check serves a python model from its config's folder; report and doctor sign the written config."""
    config = _user_folder(tmp_path, "build")
    optimized = tmp_path / "optimize.json"
    done = _infervisor("optimize", "--model", "clf", "--config", str(config), *QUICK, "--json", str(optimized))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(optimized.read_text())
    assert result["check"] is not None and result["check"]["errors"] == 0 and result["check"]["samples"] > 0
    assert result["verdict"]["outcome"] == "met" and result["written_to"] == str(config)

    # probe against the user's daemon, its runtime dir found by default ($RUNTIME_DIRECTORY), not on the line.
    runtime_dir = tmp_path / "run"
    daemon = _serve(config, runtime_dir, tmp_path / "daemon.log")
    try:
        wait_for(lambda: _serving(runtime_dir), 120, "the user's daemon serving clf")
        probed = tmp_path / "probe.json"
        env = {**os.environ, "RUNTIME_DIRECTORY": str(runtime_dir)}
        done = _infervisor("probe", "--model", "clf", "--qps", "20", "--duration", "1", "--profile-requests", "3",
                           "--json", str(probed), env=env)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

        report = tmp_path / "report.html"
        done = _infervisor("report", "--optimize", str(optimized), "--probe", str(probed), "--out", str(report))
        assert f"config: {config} (from optimize's JSON: the config it wrote)" in done.stdout, done.stdout
        page = report.read_text()
        assert hashlib.sha256(config.read_bytes()).hexdigest() in page and "--no-check" not in page
        (probe_line,) = [line for line in _repeat_lines(page) if " infervisor probe " in line]
        assert f"--runtime-dir {runtime_dir}" in probe_line
        environment = {k: v for k, v in os.environ.items() if k != "RUNTIME_DIRECTORY"}
        again = _repeat(probe_line, environment)
        assert again.returncode == 0, again.stdout + again.stderr
        assert json.loads(probed.read_text())["samples"] > 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)

    doctor = _infervisor("doctor", "--optimize", str(optimized), timeout=120)
    assert doctor.stdout.startswith(f"config: {config} (from optimize's JSON: the config it wrote)"), doctor.stdout


def test_a_check_that_cannot_serve_is_unproven_keeps_its_log_and_writes_nothing(tmp_path: Path) -> None:
    """A model its daemon cannot serve: outcome unproven with the daemon's reason, exit 3, config.json untouched."""
    config = _user_folder(tmp_path, "measured_only")
    before = config.read_bytes()
    optimized = tmp_path / "optimize.json"
    done = _infervisor("optimize", "--model", "clf", "--config", str(config), *QUICK, "--json", str(optimized))
    result: dict[str, Any] = json.loads(optimized.read_text())
    log = Path(result["check_log"])
    try:
        assert done.returncode == EXIT_UNPROVEN, done.stdout + done.stderr[-3000:]
        assert config.read_bytes() == before and result["written_to"] is None
        assert "VERDICT: unproven: the daemon check could not run" in done.stdout
        assert "this model refuses to be served" in result["verdict"]["outcome"]
        assert "this model refuses to be served" in log.read_text()

        report = tmp_path / "report.html"
        done = _infervisor("report", "--optimize", str(optimized), "--out", str(report))
        assert done.returncode == 3 and "SLA unproven" in done.stdout, done.stdout
        assert f"config: {config} (from optimize's JSON: the config it read (it wrote none))" in done.stdout
        page = report.read_text()
        assert "--no-check" not in page and "daemon check could not run" in page
        assert "These measured figures break it" not in page
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
