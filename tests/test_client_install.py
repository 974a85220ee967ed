"""A client install: `pip install infervisor` in a fresh venv has no torch, is served; its CLI says what it lacks."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from infervisor.supervisor.cli import SERVER_HINT, SERVER_MODULES, build_parser
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry

#: The client's whole dependency closure, at the versions the test suite runs with.
CLIENT_DEPS = ("pyzmq", "msgpack", "numpy")

CLIENT_SCRIPT = """
import json, sys
import numpy as np
import infervisor.protocol as protocol
from infervisor.protocol.client import Client
with Client(sys.argv[1]) as client:
    y = client.infer("tiny", {"x": np.arange(16, dtype=np.float32).reshape(1, 16)})["y"]
print(json.dumps({"protocol": protocol.__file__, "y": y.tolist(), "torch_loaded": "torch" in sys.modules}))
"""


def _run(command: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a command, failing the test with its output when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{command[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result  # type: ignore[no-any-return]


def _offline_env() -> dict[str, str]:
    """The environment without any pip configuration: the install may use only the folders it is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    # os.devnull as PIP_CONFIG_FILE makes pip skip every configuration file (global find-links, indexes).
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _wheelhouse(cache: Path) -> Path:
    """Wheels of the client's dependencies, downloaded once through the ordinary registries and kept."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CLIENT_DEPS]
    have = {p.name.split("-")[0].lower() + "==" + p.name.split("-")[1] for p in cache.glob("*.whl")}
    if all(pin.lower() in have for pin in pins):
        return cache
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(cache), *pins]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.skip(f"cannot fetch the client's dependency wheels: {result.stderr.strip()[-500:]}")
    return cache


def _project_wheel(tmp: Path) -> Path:
    """This tree built as a wheel, from a copy so the checkout gets no build/ or egg-info of its own."""
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "build", "dist", "*.egg-info"))
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
          "--wheel-dir", str(wheels), str(source)], timeout=300, env=_offline_env())  # fmt: skip
    return wheels


def test_client_install_has_no_torch_and_is_served(
    start_daemon: Callable[..., Daemon], tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """The project installs offline from its wheel plus pyzmq/msgpack/numpy alone, imports no torch, and serves."""
    assert pytestconfig.cache is not None
    house = _wheelhouse(pytestconfig.cache.mkdir("client-install-wheels"))
    wheels = _project_wheel(tmp_path)
    venv = tmp_path / "client-venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    python = str(venv / "bin" / "python")
    # No index at all: torch (or any dependency beyond the three) would fail as "no matching distribution".
    _run([python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(house),
          "--find-links", str(wheels), "infervisor"], timeout=300, env=_offline_env(), cwd=tmp_path)  # fmt: skip

    listed = json.loads(_run([python, "-m", "pip", "list", "--format=json"], timeout=60, env=_offline_env()).stdout)
    installed = {p["name"].lower() for p in listed} - {"pip", "setuptools", "wheel"}
    assert installed == {"infervisor", *CLIENT_DEPS}
    # One import name: supervisord's `supervisor` (or any other generic name) can share the environment.
    site = next((venv / "lib").glob("python*/site-packages"))
    assert not {"supervisor", "worker", "protocol", "common"} & {p.name for p in site.iterdir()}
    assert (site / "infervisor" / "protocol" / "client.py").is_file()
    no_torch = subprocess.run([python, "-I", "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    _check_cli_refuses_in_one_line(venv, tmp_path)

    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    # -I: neither the checkout (cwd, PYTHONPATH) nor a user site can stand in for the installed package.
    answer = _run([python, "-I", "-c", CLIENT_SCRIPT, daemon.endpoint], timeout=60, cwd=tmp_path)
    reply = json.loads(answer.stdout)
    assert Path(reply["protocol"]).is_relative_to(venv) and not reply["torch_loaded"]
    with daemon.client() as client:
        expected = client.infer("tiny", {"x": np.arange(16, dtype=np.float32).reshape(1, 16)})["y"]
    np.testing.assert_allclose(np.asarray(reply["y"], np.float32), expected, rtol=1e-6)


#: The arguments each subcommand cannot run without; a new subcommand fails the test until it is added here.
REQUIRED_ARGS: dict[str, list[str]] = {
    **{
        name: []
        for name in ("serve", "status", "metrics", "restart", "reload", "build", "demo", "bench", "doctor", "report")
    },
    **{name: ["--model", "tiny"] for name in ("optimize", "probe", "harden", "fallback")},
    "infer": ["--model", "tiny", "--random"],
}


def _check_cli_refuses_in_one_line(venv: Path, tmp: Path) -> None:
    """Every subcommand of the client-only install's `infervisor` prints the one line and exits 2."""
    assert set(REQUIRED_ARGS) == set(_subcommands()), "keep REQUIRED_ARGS in step with the CLI's subcommands"
    missing = ", ".join(sorted(SERVER_MODULES))
    script = str(venv / "bin" / "infervisor")
    version = _run([script, "--version"], timeout=60, cwd=tmp)
    assert version.stdout.startswith("infervisor 0."), version.stdout
    for name, args in REQUIRED_ARGS.items():
        done = subprocess.run([script, name, *args], capture_output=True, text=True, timeout=60, cwd=tmp)
        assert (done.returncode, done.stdout, done.stderr) == (
            2,
            "",
            f"infervisor {name}: {SERVER_HINT} (missing: {missing})\n",
        ), name


def _subcommands() -> list[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(actions[0].choices)


def test_the_cli_knows_the_server_extra() -> None:
    """SERVER_MODULES, which the CLI checks before any subcommand, are the `server` extra's packages."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    # A distribution's import name, where they differ, is its name with '_' for '-' (prometheus-client).
    names = {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].replace("-", "_") for requirement in extra}
    assert names == SERVER_MODULES
