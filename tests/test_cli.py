"""The `infervisor` command line as a new user meets it: real processes, run from outside the checkout too."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from infervisor.supervisor.cli import build_parser
from infervisor.supervisor.settings.config_path import CONFIG_ENV, ETC_CONFIG, ConfigPathError, resolve_config_path
from tests.cli_models import IMAGE_INPUTS, LIBRARY_LOG_TEXT, TINY_INPUTS, TORCH_LOG_TEXT, WARNING_TEXT
from tests.conftest import ROOT, Daemon, model_entry, wait_for

#: Child processes see this tree's packages (and the test models) from whatever directory they run in.
ENV = {**{k: v for k, v in os.environ.items() if k != CONFIG_ENV}, "PYTHONPATH": str(ROOT)}


def cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    """`python -m infervisor.supervisor ARGS` as a user would run it; the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "infervisor", *args],
        capture_output=True, text=True, cwd=cwd, env=env or ENV, timeout=timeout, check=False,
    )  # fmt: skip


def no_traceback(done: Any) -> None:
    """A command may fail, but with a sentence: never with Python's traceback."""
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One small daemon: a 16-float model and an image model (whose big batches are absurd)."""
    config = {
        "oversubscribe": True,
        "models": {
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
            "pool": model_entry({"python": "tests.cli_models:pool"}, IMAGE_INPUTS),
        },
    }
    started = Daemon(tmp_path_factory.mktemp("cli"), config, env={"PYTHONPATH": str(ROOT)})
    try:
        started.wait_ready()
        yield started
    finally:
        assert started.stop() == 0, started.log_text()[-3000:]


# ---- help and version -------------------------------------------------------------------------


def test_version_names_the_installed_package() -> None:
    """`infervisor --version` prints the package version from its metadata and the wire protocol version."""
    done = cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"infervisor {version('infervisor')} (wire protocol 1)"


def test_every_option_of_every_subcommand_has_help() -> None:
    """Walking the argparse tree finds no subcommand and no option without a help text (suppressed ones aside)."""
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert all(choice.help for choice in subparsers._choices_actions)
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, sub in [("infervisor", parser), *subparsers.choices.items()]
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and not action.help
    ]
    assert missing == []
    for name in subparsers.choices:
        done = cli(name, "--help")
        assert done.returncode == 0 and "usage: infervisor" in done.stdout, done.stderr


# ---- restart and reload ----------------------------------------------------------------------


def test_restart_and_reload_say_what_was_queued_or_give_json(daemon: Daemon) -> None:
    """restart and reload print a sentence, or the daemon's answer with --json; both exit 0."""
    runtime = ("--runtime-dir", str(daemon.runtime_dir))
    done = cli("restart", *runtime, "--model", "tiny")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("restart queued: 1 worker of model tiny, replaced one at a time")
    wait_for(lambda: daemon.status()["rollout"]["pending"] == 0 and daemon.status()["rollout"]["current"] is None,
             120, "rolling restart done")  # fmt: skip
    done = cli("restart", *runtime, "--json")
    assert done.returncode == 0 and json.loads(done.stdout) == {"ok": True, "queued": 2}
    done = cli("reload", *runtime)
    assert done.returncode == 0
    assert done.stdout.strip() == "reload applied (nothing changed)"
    done = cli("reload", *runtime, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True
    wait_for(lambda: daemon.status()["rollout"]["pending"] == 0 and daemon.status()["rollout"]["current"] is None,
             120, "second rolling restart done")  # fmt: skip


def test_a_refused_or_unreachable_command_exits_non_zero(daemon: Daemon, tmp_path: Path) -> None:
    """The daemon's refusal is exit 1 with its reason on stderr; no daemon at all is exit 2."""
    done = cli("restart", "--runtime-dir", str(daemon.runtime_dir), "--model", "nope")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == "infervisor restart: the daemon refused: no model 'nope'; serving ['pool', 'tiny']"
    done = cli("restart", "--runtime-dir", str(daemon.runtime_dir), "--model", "nope", "--json")
    assert done.returncode == 1 and json.loads(done.stdout)["ok"] is False
    for command in ("reload", "restart", "status"):
        done = cli(command, "--runtime-dir", str(tmp_path / "none"))
        assert done.returncode == 2 and "no daemon control socket at" in done.stderr, done.stderr
        no_traceback(done)


# ---- no tracebacks on misuse ------------------------------------------------------------------


def test_status_into_a_closed_pipe_ends_quietly(daemon: Daemon) -> None:
    """`status | head -1`: a reader that is gone costs no BrokenPipeError traceback, as table, JSON or help."""
    status = ("status", "--runtime-dir", str(daemon.runtime_dir))
    for args in (status, (*status, "--json"), ("--help",)):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader left before we write: every write hits EPIPE
        try:
            done = subprocess.run(
                [sys.executable, "-m", "infervisor", *args],
                stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV, timeout=60, check=False,
            )  # fmt: skip
        finally:
            os.close(write_end)
        assert done.stderr == "", done.stderr
        # 1 as the Python docs' recipe exits; argparse itself swallows the EPIPE of its help text.
        assert done.returncode == (0 if args == ("--help",) else 1)
    shell = subprocess.run(
        f"{sys.executable} -m infervisor status --runtime-dir {daemon.runtime_dir} | head -1",
        shell=True, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60, check=False,
    )  # fmt: skip
    assert shell.stdout.startswith("infervisor pid ") and shell.stderr == "", shell.stderr


def test_infer_refuses_an_absurd_batch_before_allocating(daemon: Daemon) -> None:
    """`infer --random --batch 100000` of an image model names the size and the frame limit; it sends nothing."""
    completed = daemon.status()["models"]["pool"]["completed"]
    done = cli("infer", "--runtime-dir", str(daemon.runtime_dir), "--model", "pool", "--random", "--batch", "100000")
    no_traceback(done)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "infervisor infer: --batch 100000 makes input 'image' [100000, 3, 224, 224] 57,422 MiB, over the daemon's "
        "frame limit of 256 MiB (max_frame_bytes); use a smaller --batch"
    )
    assert daemon.status()["models"]["pool"]["completed"] == completed
    done = cli("infer", "--runtime-dir", str(daemon.runtime_dir), "--model", "pool", "--random", "--batch", "0")
    assert done.returncode == 2 and "--batch: must be at least 1, got 0" in done.stderr
    no_traceback(done)


def test_infer_says_a_file_is_not_npy_rather_than_suggesting_allow_pickle(daemon: Daemon, tmp_path: Path) -> None:
    """A text file, an object array and a missing file as --input each get a sentence in the CLI's own terms."""
    runtime = ("--runtime-dir", str(daemon.runtime_dir), "--model", "tiny")
    done = cli("infer", *runtime, "--input", str(ROOT / "README.md"))
    no_traceback(done)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"infervisor infer: {ROOT / 'README.md'} is not a .npy or .npz file (numpy.save and numpy.savez write them)"
    )
    assert "allow_pickle" not in done.stderr
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    done = cli("infer", *runtime, "--input", str(tmp_path / "objects.npy"))
    assert done.returncode == 2 and "holds Python objects, not numeric arrays" in done.stderr, done.stderr
    assert "allow_pickle" not in done.stderr
    done = cli("infer", *runtime, "--input", str(tmp_path / "missing.npy"))
    assert done.returncode == 2 and "cannot read" in done.stderr and "No such file" in done.stderr
    np.save(tmp_path / "x.npy", np.ones((2, 16), np.float32))
    done = cli("infer", *runtime, "--input", str(tmp_path / "x.npy"), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["outputs"][0]["shape"] == [2, 16]


# ---- one config chain for every command -------------------------------------------------------


def test_the_config_chain_prefers_flag_then_environment_then_etc_then_shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--config beats $INFERVISOR_CONFIG beats /etc/infervisor/config.json beats the shipped default."""
    etc, shipped = tmp_path / "etc.json", tmp_path / "shipped.json"
    shipped.write_text("{}")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert resolve_config_path(None, etc, shipped).source == "shipped default"
    etc.write_text("{}")
    assert resolve_config_path(None, etc, shipped).path == etc
    monkeypatch.setenv(CONFIG_ENV, "env.json")
    assert resolve_config_path(None, etc, shipped).source == f"${CONFIG_ENV}"
    assert resolve_config_path("flag.json", etc, shipped).path == Path("flag.json").resolve()
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(ConfigPathError, match="no config: pass --config PATH, set \\$INFERVISOR_CONFIG"):
        resolve_config_path(None, tmp_path / "no-etc.json", tmp_path / "not-shipped.json")


def test_doctor_finds_the_config_from_any_directory(tmp_path: Path) -> None:
    """`infervisor doctor` run in an empty directory checks the shipped (or /etc) config, then the env one."""
    done = cli("doctor", cwd=tmp_path)
    no_traceback(done)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: a check failed on this box, not the inputs
    expected = f"config: {ETC_CONFIG} (from {ETC_CONFIG})" if ETC_CONFIG.is_file() else (
        f"config: {ROOT / 'configs' / 'default.json'} (from shipped default)"
    )  # fmt: skip
    assert done.stdout.splitlines()[0] == expected
    assert "[pass] instruction set" in done.stdout
    config = tmp_path / "mine.json"
    config.write_text(json.dumps({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}))
    done = cli("doctor", cwd=tmp_path, env={**ENV, CONFIG_ENV: "mine.json"})
    assert done.returncode in (0, 1)
    assert done.stdout.splitlines()[0] == f"config: {config.resolve()} (from ${CONFIG_ENV})"


def test_optimize_and_report_find_the_config_like_serve(tmp_path: Path) -> None:
    """optimize and report, run elsewhere with only $INFERVISOR_CONFIG, read that config (and no cwd-relative one)."""
    folder = tmp_path / "box"
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}))
    env = {**ENV, CONFIG_ENV: str(config)}
    done = cli("optimize", "--model", "nope", cwd=tmp_path, env=env)
    assert done.returncode == 2 and f"no model 'nope' in {config}; it has ['tiny']" in done.stdout, done.stdout
    done = cli("report", "--out", str(tmp_path / "report.html"), cwd=tmp_path, env=env)
    no_traceback(done)
    # No constraints and no evidence: unproven (3), or not met (1) where a doctor check fails on this box.
    assert done.returncode in (1, 3) and (tmp_path / "report.html").is_file(), done.stdout + done.stderr


# ---- logs are JSON ----------------------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if line.strip()]


def test_library_warnings_reach_the_log_as_json_events(tmp_path: Path) -> None:
    """A worker's Python warning and library log records are JSON events; every line the daemon writes parses."""
    config = tmp_path / "config.json"
    entry = model_entry({"python": "tests.cli_models:noisy"}, TINY_INPUTS)
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"noisy": entry}}))
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    runtime = tmp_path / "run"
    # No --config: serve takes $INFERVISOR_CONFIG, as the other commands do.
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "infervisor", "serve", "--runtime-dir", str(runtime)],
            stdout=stdout, stderr=stderr, cwd=tmp_path, env={**ENV, CONFIG_ENV: str(config)},
        )  # fmt: skip
    try:
        wait_for(lambda: process.poll() is not None or "supervisor_ready" in out.read_text(), 120, "daemon ready")
        wait_for(lambda: process.poll() is not None or "worker_ready" in err.read_text(), 30, "worker log flushed")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, out.read_text()[-2000:] + err.read_text()[-2000:]
    stdout_events = [json.loads(line) for line in _lines(out)]  # raises on any line that is not JSON
    stderr_events = [json.loads(line) for line in _lines(err)]
    chosen = stdout_events[0]
    assert (chosen["event"], chosen["config"], chosen["source"]) == ("config_chosen", str(config), f"${CONFIG_ENV}")
    warning = next(e for e in stderr_events if e["event"] == "python_warning")
    assert warning["message"] == WARNING_TEXT and warning["category"] == "UserWarning"
    assert warning["model"] == "noisy" and warning["level"] == "warning"
    records = {e["logger"]: e for e in stderr_events if e["event"] == "library_log"}
    assert records["torch"]["message"] == TORCH_LOG_TEXT and records["torch"]["model"] == "noisy"
    assert records["torchao.quantization"]["message"] == LIBRARY_LOG_TEXT
    assert all("worker_id" not in e for e in stdout_events), "a worker wrote on the supervisor's stdout"


def test_supervisor_logs_route_warnings_and_library_records_to_stdout_as_json() -> None:
    """In the supervisor, a Python warning and a library's warning record come out on stdout as JSON events."""
    script = (
        "import logging, warnings\n"
        "from infervisor.supervisor.host.logs import configure_logging\n"
        "configure_logging('info')\n"
        "warnings.warn('supervisor side warning')\n"
        "logging.getLogger('watchdog.observers').warning('a library record %s', 42)\n"
        "logging.getLogger('watchdog.observers').info('a library info record: chatter, left out')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["event"] for e in events] == ["python_warning", "library_log"]
    assert events[0]["message"] == "supervisor side warning"
    assert events[1]["message"] == "a library record 42" and events[1]["logger"] == "watchdog.observers"


# ---- demo -------------------------------------------------------------------------------------


def _demo_config(tmp_path: Path) -> Path:
    config = tmp_path / "demo.json"
    entry = model_entry({"python": "tests.cli_models:staggered"}, TINY_INPUTS, workers=2)
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "oversubscribe": True,
                                  "models": {"echo": entry}}))  # fmt: skip
    return config


def _runtime_dir(stdout: str) -> Path:
    line = next(line for line in stdout.splitlines() if line.startswith("starting: "))
    return Path(line.split("--runtime-dir ")[1].split()[0])


def test_demo_waits_for_every_worker_and_removes_its_runtime_dir(tmp_path: Path) -> None:
    """Run from outside the checkout, the demo loads only once both workers serve (slot 1 starts 4 s late)."""
    done = cli("demo", "--config", "demo.json", "--requests", "20", cwd=_demo_config(tmp_path).parent, timeout=300)
    no_traceback(done)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("every worker serves after ")[1].split("echo: one request")[0].split("\n", 1)[1]
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[2] == "serving" for row in rows), table
    (load,) = [line for line in done.stdout.splitlines() if line.startswith("echo: ") and " req/s, p50 " in line]
    assert "(20 ok, 0 errors, 2 clients" in load, load
    runtime = _runtime_dir(done.stdout)
    assert not runtime.exists()
    log = runtime.with_name(f"{runtime.name}.log")
    assert f"daemon exited with code 0; its log: {log}" in done.stdout and log.is_file()
    log.unlink()


def test_demo_shows_the_daemons_reason_when_it_cannot_start(tmp_path: Path) -> None:
    """A config the daemon refuses: the demo prints the daemon's config_invalid line, not 'exited with 78'."""
    bad = tmp_path / "bad.json"
    inputs = [{**TINY_INPUTS[0], "dtype": "float"}]
    bad.write_text(json.dumps({"models": {"tiny": model_entry({"builtin": "tiny"}, inputs)}}))
    done = cli("demo", "--config", "bad.json", cwd=tmp_path)
    no_traceback(done)
    assert done.returncode == 1
    assert (
        "infervisor demo: the daemon exited with code 78 before it served: config_invalid: "
        "models.tiny.inputs[0].dtype: must be one of"
    ) in done.stderr, done.stderr
    runtime = _runtime_dir(done.stdout)
    assert not runtime.exists()
    log = runtime.with_name(f"{runtime.name}.log")
    assert f"daemon exited with code 78; its log: {log}" in done.stdout
    log.unlink()


def test_demo_interrupted_stops_the_daemon_and_removes_its_runtime_dir(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the demo's process group) while the pool starts: daemon gone, directory gone, exit 130."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "infervisor", "demo", "--config", str(_demo_config(tmp_path))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ENV, start_new_session=True,
        # As from a terminal: a suite started in the background (`cmd &`) ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        children = wait_for(lambda: psutil.Process(demo.pid).children(recursive=True), 60, "daemon spawned")
        daemon = children[0]
        wait_for(lambda: len(psutil.Process(demo.pid).children(recursive=True)) >= 3, 60, "workers spawned")
        os.killpg(demo.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        stdout, stderr = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert "Traceback" not in stdout + stderr, stderr
    assert demo.returncode == 130 and "infervisor demo: interrupted, stopping the daemon" in stderr, stdout + stderr
    assert not psutil.pid_exists(daemon.pid) or daemon.status() == psutil.STATUS_ZOMBIE
    runtime = _runtime_dir(stdout)
    assert not runtime.exists()
    runtime.with_name(f"{runtime.name}.log").unlink()
