"""Fixtures that run the real daemon: a config in tmp, `infervisor serve` as a child, polled with deadlines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from infervisor.protocol.client import Client
from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.protocol.control_client import ControlError, control_request

ROOT = Path(__file__).resolve().parent.parent
# Workers start with `python -P`, which puts no working directory on their path: the test models
# (`{"python": "tests.fault_models:..."}`) are found the documented way, through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

TINY_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 16]}]
#: One static shape: the aoti profile compiles a single package (no batch buckets).
STATIC_TINY_INPUTS = [{"name": "x", "dtype": "float32", "shape": [1, 16]}]
IMAGE_INPUTS = [{"name": "image", "dtype": "float32", "shape": [None, 3, 224, 224]}]
ENCODER_INPUTS = [
    {"name": "input_ids", "dtype": "int64", "shape": [None, 128]},
    {"name": "attention_mask", "dtype": "int64", "shape": [None, 128]},
]


def write_thermal_sysfs(root: Path, temp_c: float, throttles: int) -> None:
    """A fake sysfs for the thermal monitor: one zone, cpu0's throttle counter and its clock at half speed."""
    zone = root / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "temp").write_text(f"{int(temp_c * 1000)}\n")
    throttle = root / "devices" / "system" / "cpu" / "cpu0" / "thermal_throttle"
    throttle.mkdir(parents=True, exist_ok=True)
    (throttle / "core_throttle_count").write_text(f"{throttles}\n")
    freq = root / "devices" / "system" / "cpu" / "cpu0" / "cpufreq"
    freq.mkdir(parents=True, exist_ok=True)
    (freq / "scaling_cur_freq").write_text("1800000\n")
    (freq / "cpuinfo_max_freq").write_text("3600000\n")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy, failing with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


#: Fixtures that start a daemon, worker processes or a long build: a test using one (directly or through another
#: fixture) is marked `daemon`, and the fast tier (`./dev test fast`: `-m "not daemon"`) leaves it out.
DAEMON_FIXTURES = frozenset({"start_daemon", "built_tiny_aoti"})
#: Names whose use in a fixture's or a test's own code marks it the same way (a module's shared daemon, a worker).
DAEMON_NAMES = frozenset({"Daemon", "start_daemon", "launch_worker", "built_tiny_aoti"})
#: `infervisor` subcommands that start workers or a daemon: a test that runs one as a process is marked too, as is
#: one that runs a script of bench/ (they start daemons and measure).
WORKER_COMMANDS = frozenset({"serve", "demo", "optimize", "bench", "build", "probe", "harden"})
#: Set before each test's fixtures: whether that test is marked `daemon` (see `Daemon.__init__`).
_RUNNING: dict[str, Any] = {"marked": True, "fast_tier": False, "test": ""}


def _code_used(function: Any, seen: set[int] | None = None) -> tuple[set[str], set[str]]:
    """The global and attribute names and the string constants of a function's code, with those of its nested
    functions and of the functions of its own module it calls (a module's `_start_daemon(...)` helper)."""
    seen = set() if seen is None else seen
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen:
        return set(), set()
    seen.add(id(code))
    names: set[str] = set()
    strings: set[str] = set()
    codes = [code]
    while codes:
        current = codes.pop()
        names |= set(current.co_names)
        strings |= {const for const in current.co_consts if isinstance(const, str)}
        codes += [const for const in current.co_consts if isinstance(const, types.CodeType)]
    module_globals = getattr(function, "__globals__", {})
    for name in list(names):
        helper = module_globals.get(name)
        if getattr(helper, "__module__", None) != function.__module__:
            continue
        # A helper function of the module, or the methods of a class it defines (a Daemon subclass of its own).
        helpers = [helper] if isinstance(helper, types.FunctionType) else []
        if isinstance(helper, type):
            helpers = [member for member in vars(helper).values() if isinstance(member, types.FunctionType)]
        for each in helpers:
            more_names, more_strings = _code_used(each, seen)
            names |= more_names
            strings |= more_strings
    return names, strings


def _starts_daemon(item: pytest.Item) -> bool:
    """Whether the test uses a daemon fixture, or its code or one of its fixtures' refers to a daemon or a worker,
    or runs an infervisor command that starts workers (or a bench/ script) as a process."""
    if DAEMON_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for definitions in (info.name2fixturedefs.values() if info is not None else ()):
        functions += [definition.func for definition in definitions]
    for function in functions:
        if function is None:
            continue
        names, strings = _code_used(function)
        if DAEMON_NAMES & names or any(s.startswith("bench/") for s in strings):
            return True
        if "infervisor" in strings and WORKER_COMMANDS & strings:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `daemon` every test that starts a daemon or worker processes (by the fixtures and names it uses)."""
    for item in items:
        if item.get_closest_marker("daemon") is None and _starts_daemon(item):
            item.add_marker(pytest.mark.daemon)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Remember whether the test about to run is marked `daemon`, for the fast tier's guard in `Daemon`."""
    markexpr = str(item.config.getoption("markexpr", "") or "")
    _RUNNING.update(
        marked=item.get_closest_marker("daemon") is not None,
        fast_tier="not daemon" in markexpr,
        test=item.nodeid,
    )


class Daemon:
    """A running `infervisor serve` child process with its runtime dir and log file."""

    def __init__(
        self,
        tmp: Path,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        command_prefix: Sequence[str] = (),
        cwd: Path = ROOT,
    ) -> None:
        """`command_prefix` runs `infervisor serve` through another command (as another user, for one)."""
        if _RUNNING["fast_tier"] and not _RUNNING["marked"]:
            # The fast tier must stay fast: a daemon started by a test it kept means a mark is missing.
            raise AssertionError(f"{_RUNNING['test']} starts a daemon: mark it @pytest.mark.daemon")
        self.tmp = tmp
        self.runtime_dir = tmp / "run"
        self.config_path = tmp / "config.json"
        # Compiled packages go to a per-test cache unless the test shares one on purpose.
        self.config_path.write_text(json.dumps({"cache_dir": str(tmp / "cache"), **config}, indent=2))
        self.log_path = tmp / "daemon.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                *command_prefix,
                sys.executable,
                "-m",
                "infervisor",
                "serve",
                "--config",
                str(self.config_path),
                "--runtime-dir",
                str(self.runtime_dir),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **(env or {})},
        )
        self.endpoint = f"ipc://{self.runtime_dir / CLIENT_SOCKET_NAME}"

    def write_config(self, config: dict[str, Any], atomic: bool = True) -> None:
        """Replace config.json the way editors and deploy tools do: a temp file renamed over it, or in place."""
        text = json.dumps({"cache_dir": str(self.tmp / "cache"), **config}, indent=2)
        if atomic:
            temp = self.config_path.with_suffix(".tmp")
            temp.write_text(text)
            os.replace(temp, self.config_path)
        else:
            with self.config_path.open("w") as handle:
                handle.write(text)

    def status(self) -> dict[str, Any]:
        """The daemon's status document."""
        return control_request(self.runtime_dir, {"cmd": "status"}, timeout=10.0)

    def control(self, command: dict[str, Any]) -> dict[str, Any]:
        """Any control-socket command."""
        return control_request(self.runtime_dir, command, timeout=10.0)

    def try_status(self) -> dict[str, Any] | None:
        """Status, or None while the daemon is not answering yet."""
        if self.process.poll() is not None:
            raise AssertionError(f"daemon exited with {self.process.returncode}:\n{self.log_text()[-4000:]}")
        try:
            return self.status()
        except ControlError:
            return None

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        """Block until every worker of every model serves."""

        def all_serving() -> dict[str, Any] | None:
            status = self.try_status()
            if status is None:
                return None
            workers = [w for m in status["models"].values() for w in m["workers"]]
            return status if workers and all(w["state"] == "serving" for w in workers) else None

        result: dict[str, Any] = wait_for(all_serving, timeout, "all workers serving")
        return result

    def client(self) -> Client:
        """A new client on the daemon's ipc endpoint."""
        return Client(self.endpoint)

    def worker_pids(self) -> list[int]:
        """Child worker pids as the OS sees them."""
        try:
            return [c.pid for c in psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def log_text(self) -> str:
        """Everything the daemon and its workers printed."""
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict[str, Any]]:
        """The JSON log lines as dicts (non-JSON lines are skipped)."""
        events = []
        for line in self.log_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
        return events

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._log.close()
        return code


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory for daemons that are always stopped (and their workers checked gone) at teardown."""
    daemons: list[Daemon] = []

    def start(config: dict[str, Any], env: dict[str, str] | None = None, subdir: str = "d") -> Daemon:
        folder = tmp_path / f"{subdir}{len(daemons)}"
        folder.mkdir()
        daemon = Daemon(folder, config, env)
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        pids = daemon.worker_pids()
        daemon.stop()
        for pid in pids:
            wait_for(
                lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
                10,
                f"worker {pid} gone",
            )


def free_loopback_port() -> int:
    """A tcp port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def model_entry(source: dict[str, str], inputs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A config.json model entry.

    Its workers build their chain before READY (`build: at_start`), so a test that asks for a profile finds it
    serving at READY; the tests of the background builder (test_serve_first.py) say `build="background"`.
    """
    return {"source": source, "inputs": inputs, "warmup_iterations": 1, "build": "at_start", **extra}


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    yield sock
    sock.close()


def notify_messages(
    sock: socket.socket, until: Callable[[list[str]], bool], timeout: float, seen: list[str]
) -> list[str]:
    """Datagrams received on the fake NOTIFY_SOCKET, appended to `seen`, until `until(seen)` holds."""
    deadline = time.monotonic() + timeout
    while not until(seen):
        if time.monotonic() > deadline:
            raise AssertionError(f"notify sequence incomplete: {seen}")
        try:
            seen.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
    return seen


@pytest.fixture(scope="session")
def built_tiny_aoti(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding tiny's static aoti package, compiled once by `infervisor build` for the tests that copy it.

    Their subject is what happens to a built package (damaged, exported, imported); compiling it again in
    each of them would only repeat what the build phase's own tests prove.
    """
    folder = tmp_path_factory.mktemp("built-tiny-aoti")
    config = folder / "build.json"
    entry = model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS, outputs=["y"], profiles=["aoti"])
    config.write_text(json.dumps({"cache_dir": str(folder / "cache"), "models": {"m": entry}}))
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "build", "--config", str(config)],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"infervisor build of tiny's aoti package failed:\n{done.stdout}{done.stderr}")
    return folder / "cache"
