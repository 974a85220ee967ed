"""Strict modes and config reading: nothing is loaded from a file another local user could write, and config.json
that is not a small regular file is refused without stalling the daemon.

Where another user is involved it is a real second uid, made with useradd for the module and removed after it;
it writes its files itself (setpriv), into a folder it may write to, as an attacker with a local account would.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq.auth

from infervisor.common.strict_modes import STRICT_ENV, UnsafePath, check_file, check_tree, read_small_file
from tests.conftest import STATIC_TINY_INPUTS, TINY_INPUTS, Daemon, free_loopback_port, model_entry, wait_for

TINY = {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=1, outputs=["y"])}


@dataclass(frozen=True)
class Attacker:
    """Another local account: its uid and gid, and a folder (1777, like /tmp) where it may write."""

    uid: int
    gid: int
    shared: Path

    def write(self, path: Path, data: bytes, mode: int = 0o666) -> None:
        """Write `path` as this user (umask 0), then chmod it to `mode` as this user."""
        script = 'umask 0; cat > "$1"; chmod "$2" "$1"'
        command = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--",
                   "sh", "-c", script, "sh", str(path), f"{mode:o}"]  # fmt: skip
        subprocess.run(command, input=data, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def attacker() -> Iterator[Attacker]:
    """A user made for these tests (removed after them) and a world-writable sticky folder it writes in."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("making a second user and acting as it needs root, useradd and setpriv")
    name = f"ivsm{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True, timeout=60)  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="infervisor-strict-"))
    try:
        base.chmod(0o755)
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        import pwd

        entry = pwd.getpwnam(name)
        yield Attacker(entry.pw_uid, entry.pw_gid, shared)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["userdel", name], check=False, capture_output=True, timeout=60)


def serve_once(config_path: Path, runtime_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`infervisor serve` on a config that may not start (its output piped)."""
    command = [sys.executable, "-m", "infervisor", "serve", "--config", str(config_path),
               "--runtime-dir", str(runtime_dir)]  # fmt: skip
    environment = {**os.environ, **(env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment)


def refused_at_start(config_path: Path, runtime_dir: Path, env: dict[str, str] | None = None) -> str:
    """The log of a daemon that must exit 78 on this config (it is killed, and the test fails, if it serves)."""
    process = serve_once(config_path, runtime_dir, env)
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"the daemon started on an unsafe config:\n{output.decode()[-3000:]}") from None
    assert process.returncode == 78, output.decode()[-3000:]
    return output.decode()


# ---------------------------------------------------------------------------------------------- the check itself


def test_the_check_refuses_a_foreign_or_writable_file_and_a_writable_holder(tmp_path: Path) -> None:
    """A 0666 file, a file in a 0777 folder and a FIFO are refused with a reason; a 0644 file in a 0700 one passes;
    a sticky /tmp above is allowed, as sshd allows nothing less for a home in it."""
    good = tmp_path / "good.json"
    good.write_text("{}")
    check_file(good)
    loose = tmp_path / "loose.json"
    loose.write_text("{}")
    loose.chmod(0o666)
    with pytest.raises(UnsafePath, match="writable by group and others"):
        check_file(loose)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o1777)
    (open_folder / "c.json").write_text("{}")
    with pytest.raises(UnsafePath, match="unsafe place: folder .* writable"):
        check_file(open_folder / "c.json")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePath, match="a FIFO, not a regular file"):
        read_small_file(tmp_path / "fifo")
    tree = tmp_path / "cache"
    (tree / "inductor").mkdir(parents=True)
    check_tree(tree)
    (tree / "inductor").chmod(0o777)
    with pytest.raises(UnsafePath, match="inductor is writable"):
        check_tree(tree)


def test_the_opt_out_lets_a_writable_file_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """INFERVISOR_STRICT_MODES=off skips the ownership checks, never the regular-file and size checks."""
    loose = tmp_path / "loose.json"
    loose.write_text("{}")
    loose.chmod(0o666)
    monkeypatch.setenv(STRICT_ENV, "off")
    assert read_small_file(loose) == b"{}"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePath, match="FIFO"):
        read_small_file(tmp_path / "fifo")


# ------------------------------------------------------------------------------------- attack 2: code and config


def test_a_config_symlinked_to_a_writable_file_is_refused_at_start(tmp_path: Path, attacker: Attacker) -> None:
    """config.json as a symlink to a 0666 file in a 1777 folder, written by another user: exit 78, saying why."""
    target = attacker.shared / f"config-{secrets.token_hex(3)}.json"
    attacker.write(target, json.dumps({"models": TINY}).encode())
    link = tmp_path / "config.json"
    link.symlink_to(target)
    output = refused_at_start(link, tmp_path / "run")
    assert "config_invalid" in output and f"uid {attacker.uid}" in output, output


def test_a_module_another_user_wrote_is_never_imported(tmp_path: Path, attacker: Attacker) -> None:
    """A `python` model found in a world-writable PYTHONPATH folder, written by another user: exit 78 with the
    reason, and the module's code never ran."""
    name = f"planted_{secrets.token_hex(3)}"
    proof = tmp_path / "ran"
    code = f"open({str(proof)!r}, 'w').write('ran')\nimport torch\n\ndef make():\n    return torch.nn.Linear(16, 4)\n"
    attacker.write(attacker.shared / f"{name}.py", code.encode())
    config = tmp_path / "config.json"
    model = model_entry({"python": f"{name}:make"}, TINY_INPUTS, workers=1)
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"m": model}}))
    python_path = os.pathsep.join([os.environ["PYTHONPATH"], str(attacker.shared)])
    output = refused_at_start(config, tmp_path / "run", {"PYTHONPATH": python_path})
    assert f"refused '{name}'" in output and f"owned by uid {attacker.uid}" in output, output
    assert not proof.exists()


def test_a_module_imported_from_a_world_writable_folder_is_refused_in_the_worker(
    tmp_path: Path, attacker: Attacker
) -> None:
    """A safe model module that imports a helper another user planted: the worker refuses the helper (load error
    in status, the helper's code never runs) and the daemon stays up."""
    app = tmp_path / "app"
    app.mkdir()
    helper = f"helper_{secrets.token_hex(3)}"
    proof = tmp_path / "ran"
    code = f"import torch\n\ndef make():\n    import {helper}\n    return torch.nn.Linear(16, 4)\n"
    (app / "safe_model.py").write_text(code)
    attacker.write(attacker.shared / f"{helper}.py", f"open({str(proof)!r}, 'w').write('ran')\n".encode())
    model = model_entry({"python": "safe_model:make"}, TINY_INPUTS, workers=1)
    python_path = os.pathsep.join([os.environ["PYTHONPATH"], str(attacker.shared)])
    daemon = Daemon(app, {"models": {"m": model, **TINY}}, env={"PYTHONPATH": python_path})
    try:
        status = wait_for(lambda: _load_error(daemon, "m"), 120, "the model's load error")
        assert f"refused '{helper}'" in status and f"owned by uid {attacker.uid}" in status, status
        assert not proof.exists()
    finally:
        daemon.stop()


def _load_error(daemon: Daemon, model: str) -> str | None:
    status = daemon.try_status()
    if status is None:
        return None
    for worker in status["models"][model]["workers"]:
        if worker.get("load_error"):
            return str(worker["load_error"])
    return None


def test_the_config_folder_is_not_left_on_the_import_path(tmp_path: Path) -> None:
    """After a `python` model is built, its config's folder is off sys.path: a later import cannot find a file
    lying there."""
    from infervisor.protocol.launch import ModelSource
    from infervisor.worker.loader import load_model

    (tmp_path / "beside_config.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    (tmp_path / "later_optional_name.py").write_text("raise SystemExit('imported from the config folder')\n")
    load_model(ModelSource("python", name="beside_config:make", search_dir=str(tmp_path)))
    assert str(tmp_path) not in sys.path
    with pytest.raises(ModuleNotFoundError):
        __import__("later_optional_name")


# -------------------------------------------------------------------------------- attack 5: config not a small file


def _reload_error(daemon: Daemon) -> list[str] | None:
    started = time.monotonic()
    status = daemon.status()
    assert time.monotonic() - started < 1.0, "status took a second or more"
    error = status["config"]["last_error"]
    return list(error) if error else None


def _serves(daemon: Daemon) -> None:
    with daemon.client() as client:
        y = client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, timeout=10)["y"]
    assert y.shape == (1, 16)


def test_a_fifo_at_the_config_path_never_stalls_the_daemon(start_daemon: Callable[..., Daemon]) -> None:
    """config.json replaced by a FIFO (through a symlink): the reload is refused with the reason, status answers
    within a second and requests are served throughout."""
    daemon = start_daemon({"models": TINY})
    daemon.wait_ready()
    fifo = daemon.tmp / "pipe"
    os.mkfifo(fifo, 0o600)
    link = daemon.tmp / "config.link"
    link.symlink_to(fifo)
    os.replace(link, daemon.config_path)
    problems = wait_for(lambda: _reload_error(daemon), 30, "the refused reload")
    assert any("a FIFO, not a regular file" in p for p in problems), problems
    for _ in range(5):
        _serves(daemon)
        assert _reload_error(daemon) is not None
    assert daemon.control({"cmd": "reload"})["ok"] is False


def test_a_huge_config_is_refused_before_it_is_read(start_daemon: Callable[..., Daemon]) -> None:
    """A 2 MB (valid JSON) config.json: the reload is refused for its size, and the daemon keeps serving."""
    daemon = start_daemon({"models": TINY})
    daemon.wait_ready()
    text = json.dumps({"cache_dir": str(daemon.tmp / "cache"), "models": TINY}) + " " * (2 << 20)
    temporary = daemon.tmp / "big.tmp"
    temporary.write_text(text)
    os.replace(temporary, daemon.config_path)
    problems = wait_for(lambda: _reload_error(daemon), 30, "the refused reload")
    assert any("over the 1,048,576-byte limit" in p for p in problems), problems
    _serves(daemon)


# ------------------------------------------------------------------------------------------------ CURVE key files


def _curve_config(tmp_path: Path) -> tuple[Path, Path, Path]:
    keys = tmp_path / "keys"
    clients = keys / "clients"
    clients.mkdir(parents=True)
    _, secret = zmq.auth.create_certificates(keys, "server")
    Path(secret).chmod(0o600)
    zmq.auth.create_certificates(clients, "app")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "cache_dir": str(tmp_path / "cache"), "models": TINY, "tcp_endpoint": f"tcp://127.0.0.1:{free_loopback_port()}",
        "curve": {"server_secret_key": str(secret), "authorized_clients": str(clients)},
    }))  # fmt: skip
    return config, Path(secret), clients


def test_a_client_key_without_public_key_stops_the_start_with_78(tmp_path: Path) -> None:
    """A client key file with no `public-key` line: exit 78 naming the file and what is missing."""
    config, _, clients = _curve_config(tmp_path)
    (clients / "broken.key").write_text("metadata\ncurve\n")
    output = refused_at_start(config, tmp_path / "run")
    assert f"{clients / 'broken.key'} has no public-key line" in output, output


def test_a_server_key_without_secret_key_stops_the_start_with_78(tmp_path: Path) -> None:
    """The server's key file with its public key only: exit 78 (no traceback) naming the file and what is missing."""
    config, secret, _ = _curve_config(tmp_path)
    secret.write_text("\n".join(line for line in secret.read_text().splitlines() if "secret-key" not in line))
    output = refused_at_start(config, tmp_path / "run")
    assert f"{secret} has no secret-key line" in output and "Traceback" not in output, output


def test_a_key_another_user_can_write_is_refused(tmp_path: Path) -> None:
    """A client key file writable by others lets anyone add a client: exit 78, saying so."""
    config, _, clients = _curve_config(tmp_path)
    (clients / "app.key").chmod(0o666)
    output = refused_at_start(config, tmp_path / "run")
    assert "app.key is writable by group and others" in output, output


def test_a_server_secret_key_others_can_read_stops_the_start_with_78(tmp_path: Path) -> None:
    """The server's secret key at 0644 (pyzmq's mode under umask 022) lets every local user pose as the daemon:
    exit 78 naming the file, as sshd refuses such a host key."""
    config, secret, _ = _curve_config(tmp_path)
    secret.chmod(0o644)
    output = refused_at_start(config, tmp_path / "run")
    assert f"secret key file {secret} is readable by group and others (mode 0644)" in output, output


# ------------------------------------------------------------------------------ a read-only bind mount is no pass


def _bound(source: Path, target: Path, command: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """`command` run in a private mount namespace where `source` is bind-mounted read-only on `target`: its exit
    code and output (-1 when it was still running after 60 s, as a daemon that accepted the config is)."""
    script = 'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'
    namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(source), str(target)]
    environment = {**os.environ, **(env or {})}
    process = subprocess.Popen(
        [*namespace, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment
    )
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        return -1, output.decode()
    return process.returncode, output.decode()


@pytest.fixture
def bind_source(tmp_path: Path) -> tuple[Path, Path]:
    """A root-owned 0777 folder holding a 0666 config.json and a 0666 `python` model module (anyone may rewrite
    both through this path), and an empty 0755 folder to bind it on read-only."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private mount namespace and a bind mount need root and unshare")
    source, target = tmp_path / "shared", tmp_path / "etc-infervisor"
    source.mkdir()
    target.mkdir(mode=0o755)
    module = f"bound_{secrets.token_hex(3)}"
    (source / f"{module}.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(16, 4)\n")
    model = model_entry({"python": f"{module}:make"}, TINY_INPUTS, workers=1)
    (source / "config.json").write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"m": model}}))
    for path in (source / f"{module}.py", source / "config.json", source):
        path.chmod(0o777 if path == source else 0o666)
    return source, target


def test_a_config_on_a_read_only_bind_of_a_writable_folder_is_refused(
    tmp_path: Path, bind_source: tuple[Path, Path]
) -> None:
    """config.json on a read-only bind mount whose source is a 0777 folder: exit 78 saying the file is writable
    (the mount being read-only says nothing of its source, which anyone may rewrite)."""
    source, target = bind_source
    serve = [sys.executable, "-m", "infervisor", "serve", "--config", str(target / "config.json"),
             "--runtime-dir", str(tmp_path / "run")]  # fmt: skip
    code, output = _bound(source, target, serve)
    assert code == 78, output[-3000:]
    assert f"{target / 'config.json'} is writable by group and others (mode 0666)" in output, output[-3000:]


def test_a_model_module_on_a_read_only_bind_of_a_writable_folder_is_refused(
    tmp_path: Path, bind_source: tuple[Path, Path]
) -> None:
    """A safe config naming a `python` model found on that mount: exit 78 refusing the module, never imported."""
    source, target = bind_source
    (module,) = (path.stem for path in source.glob("bound_*.py"))
    config = tmp_path / "config.json"
    config.write_text((source / "config.json").read_text())
    serve = [sys.executable, "-m", "infervisor", "serve", "--config", str(config),
             "--runtime-dir", str(tmp_path / "run")]  # fmt: skip
    python_path = os.pathsep.join([os.environ["PYTHONPATH"], str(target)])
    code, output = _bound(source, target, serve, {"PYTHONPATH": python_path})
    assert code == 78, output[-3000:]
    assert f"refused '{module}'" in output and "writable by group and others" in output, output[-3000:]


def test_only_a_read_only_mount_point_the_operator_names_waives_mode_bits(bind_source: tuple[Path, Path]) -> None:
    """INFERVISOR_TRUSTED_MOUNTS naming that read-only mount point waives its mode bits (a ConfigMap volume); naming
    a folder that is not a mount point, or nothing, waives nothing."""
    source, target = bind_source
    probe = ("import sys\nfrom pathlib import Path\nfrom infervisor.common.strict_modes import UnsafePath, check_file\n"
             "try:\n    check_file(Path(sys.argv[1]))\n    print('passed')\nexcept UnsafePath as exc:\n"
             "    print('refused:', exc)\n")  # fmt: skip
    verdicts = {}
    for named in ("", str(target), str(target.parent)):
        code, output = _bound(source, target, [sys.executable, "-c", probe, str(target / "config.json")],
                              {"INFERVISOR_TRUSTED_MOUNTS": named})  # fmt: skip
        assert code == 0, output
        verdicts[named] = output.strip()
    assert verdicts[str(target)] == "passed", verdicts
    assert verdicts[""].startswith("refused:") and verdicts[str(target.parent)].startswith("refused:"), verdicts


# ------------------------------------------------------------------------------------ attack 1: code from the cache


def test_a_package_planted_in_a_writable_cache_is_never_loaded(
    tmp_path: Path, attacker: Attacker, built_tiny_aoti: Path
) -> None:
    """A cache_dir others may write, where another user replaced the aoti package and its .sha256 with a matching
    pair: the worker refuses the whole cache with the reason in status, serves eager, and never reads the package
    (it is neither loaded nor moved aside)."""
    chain = {"tiny": model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS, workers=1, outputs=["y"],
                                 profiles=["aoti", "eager"])}  # fmt: skip
    # Under a folder the other user may pass through (tmp_path is root's 0700), as /var/cache is.
    tmp_path = attacker.shared.parent / f"box-{secrets.token_hex(3)}"
    tmp_path.mkdir(mode=0o755)
    # The package as a build left it (tests/conftest.py compiled it once for the session).
    cache = Path(shutil.copytree(built_tiny_aoti, tmp_path / "cache", symlinks=True))
    (package,) = cache.glob("aoti-*.pt2")
    cache.chmod(0o777)  # a cache shared too widely: the setup
    planted = b"PK\x03\x04 not a package, but the attacker's own code would be here"
    package.unlink()
    attacker.write(package, planted, 0o644)
    digest = subprocess.run(["sha256sum", str(package)], capture_output=True, text=True, check=True).stdout
    package.with_suffix(".sha256").unlink()
    attacker.write(package.with_suffix(".sha256"), digest.replace(str(package), package.name).encode(), 0o644)
    (tmp_path / "again").mkdir()
    again = Daemon(tmp_path / "again", {"cache_dir": str(cache), "models": chain})
    try:
        (worker,) = again.wait_ready(300)["models"]["tiny"]["workers"]
        assert worker["profile"] == "eager", worker
        assert "refused" in worker["profile_skipped"][0] and "writable" in worker["profile_skipped"][0], worker
        assert package.read_bytes() == planted and not list(cache.glob("*.corrupt"))
    finally:
        again.stop()


def test_a_reload_with_a_bad_key_changes_nothing_and_says_why(tmp_path: Path) -> None:
    """The reload path reads the config like the start: a client key that lost its public-key line is a refused
    config (the reloader keeps the running one) naming the file."""
    from infervisor.supervisor.settings.config import ConfigError, load_config

    config, _, clients = _curve_config(tmp_path)
    load_config(config)
    (clients / "app.key").write_text("metadata\ncurve\n")
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert refused.value.problems == [f"curve: {clients / 'app.key'} has no public-key line"]
