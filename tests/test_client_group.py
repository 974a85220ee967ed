"""Config `socket_group`: local clients of other uids, in the group and outside it, against a daemon of its own user.

The daemon runs as a dedicated user that is a member of the client group, as under the shipped unit;
the clients run as two more users, one in the group and one outside it. The users and the group are
made with useradd/groupadd for the session and removed after it, so these tests need root.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import secrets
import shlex
import shutil
import site
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import CLIENT_SOCKET_NAME, CONTROL_SOCKET_NAME, SHM_DIR, STATUS_SOCKET_NAME
from infervisor.protocol.shared_memory import SharedRegion
from infervisor.supervisor.host.socket_group import MAX_GID, SocketGroup
from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry

#: What the daemon and the clients import, copied where every test user can read it (the checkout may not be).

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making users and groups and acting as them needs root")

#: Run as a client user: a raw connect() to infer.sock, then requests through the Python client; prints JSON.
CLIENT_SCRIPT = r"""
import json, os, socket, sys
import numpy as np
from infervisor.protocol.client import Client
from infervisor.protocol.errors import InferenceError
from infervisor.protocol.shared_memory import SharedRegion

run_dir, timeout, other_gid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
path = os.path.join(run_dir, "infer.sock")
out = {}
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
    out["connect"] = probe.connect_ex(path)
x = np.arange(16, dtype=np.float32).reshape(1, 16)

def ask(client, inputs):
    try:
        return {"y": client.infer("tiny", inputs, timeout=timeout)["y"].tolist()}
    except InferenceError as exc:
        return {"code": str(exc.code), "message": exc.message}

with Client("ipc://" + path) as client:
    out["frames"] = ask(client, {"x": x})
    if out["connect"] == 0:
        # The daemon's socket_group is the group of infer.sock: the object is given to it, 0640.
        with SharedRegion(4096, group=os.stat(path).st_gid) as region:
            tensor = region.tensor(np.float32, (1, 16))
            tensor.array[:] = x
            info = os.stat(os.path.join("/dev/shm", region.name))
            out["shm_object"] = [info.st_uid, info.st_gid, info.st_mode & 0o7777]
            out["shm"] = ask(client, {"x": tensor})
        with SharedRegion(4096) as own:  # the client's own uid and primary group, 0600
            tensor = own.tensor(np.float32, (1, 16))
            tensor.array[:] = x
            out["own"] = ask(client, {"x": tensor})
        try:
            SharedRegion(4096, group=other_gid).close()
            out["other_group"] = "created"
        except PermissionError as exc:
            out["other_group"] = str(exc)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Account:
    """A test user: its name, uid and primary gid."""

    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class Accounts:
    """The daemon's user (in the client group), a client in the group, one outside it, and the group itself."""

    daemon: Account
    member: Account
    outsider: Account
    clients: SocketGroup
    #: A folder every test user can enter, holding the copied packages (`tree`) and the daemons' folders.
    base: Path
    #: Folders on the way to the interpreter that other users cannot enter, with the entries needed in each.
    hidden: dict[Path, list[str]]

    @property
    def tree(self) -> Path:
        return self.base / "tree"

    def command(self, account: Account) -> list[str]:
        """What runs a command as `account` with the groups the group database gives it (as systemd would)."""
        become = ["setpriv", f"--reuid={account.uid}", f"--regid={account.gid}", "--init-groups", "--"]
        if not self.hidden:
            return become
        # This interpreter lives under a folder only root may enter (pyenv under /root, 0700): in a mount
        # namespace of the child's own, that folder becomes an open tmpfs holding only the entries needed,
        # bound from the real ones. Nothing changes outside the child; its permissions within are the real ones.
        lines = ["set -e"]
        for index, (folder, names) in enumerate(self.hidden.items()):
            for number, name in enumerate(names):
                lines.append(f"mount --bind {shlex.quote(str(folder / name))} {self.base}/stash/{index}-{number}")
            lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(str(folder))}")
            for number, name in enumerate(names):
                target = shlex.quote(str(folder / name))
                make = "mkdir" if (self.base / "stash" / f"{index}-{number}").is_dir() else "touch"
                lines += [f"{make} {target}", f"mount --bind {self.base}/stash/{index}-{number} {target}"]
        lines.append('exec "$@"')
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(lines), "sh", *become]


def _root(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=60)


def _account(name: str) -> Account:
    entry = pwd.getpwnam(name)
    return Account(name, entry.pw_uid, entry.pw_gid)


def _hidden_folders() -> dict[Path, list[str]]:
    """Folders other users cannot enter on the way to this interpreter, its prefixes and its site-packages."""
    needed = {Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(sys.base_prefix)}
    needed |= {Path(p) for p in site.getsitepackages()}
    hidden: dict[Path, set[str]] = {}
    for path in needed:
        for folder in reversed(path.resolve().parents):
            if not folder.stat().st_mode & stat.S_IXOTH:
                hidden.setdefault(folder, set()).add(path.resolve().relative_to(folder).parts[0])
    if any(inner != outer and inner.is_relative_to(outer) for inner in hidden for outer in hidden):
        pytest.skip(f"the interpreter is behind nested folders other users cannot enter: {sorted(hidden)}")
    return {folder: sorted(names) for folder, names in hidden.items()}


@pytest.fixture(scope="session")
def accounts() -> Iterator[Accounts]:
    """Three users and a client group for the session (removed after it), and a folder they can all read."""
    if os.geteuid() != 0:
        pytest.skip("making users and groups and acting as them needs root")
    missing = [tool for tool in ("useradd", "groupadd", "setpriv", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} on this box")
    tag = f"ivsg{secrets.token_hex(3)}"
    group, users = f"{tag}-clients", {"daemon": f"{tag}-d", "member": f"{tag}-in", "outsider": f"{tag}-out"}
    made: list[str] = []
    made_group = False
    base = Path(tempfile.mkdtemp(prefix="infervisor-group-"))
    try:
        _root("groupadd", group)
        made_group = True
        for role, name in users.items():
            extra = ["--groups", group] if role != "outsider" else []
            _root("useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                  "--user-group", *extra, name)  # fmt: skip
            made.append(name)
        base.chmod(0o755)
        # With __pycache__: the test users could not write one.
        shutil.copytree(ROOT / "infervisor", base / "tree" / "infervisor")
        hidden = _hidden_folders()
        for index, (folder, names) in enumerate(hidden.items()):
            for number, name in enumerate(names):
                stash = base / "stash" / f"{index}-{number}"
                stash.parent.mkdir(exist_ok=True)
                stash.mkdir() if (folder / name).is_dir() else stash.touch()
        found = Accounts(
            _account(users["daemon"]),
            _account(users["member"]),
            _account(users["outsider"]),
            SocketGroup(grp.getgrnam(group).gr_gid, group),
            base,
            hidden,
        )
        imports = "import numpy, zmq, infervisor.protocol"
        probe = subprocess.run([*found.command(found.outsider), sys.executable, "-c", imports],
                               capture_output=True, text=True, timeout=120, cwd=found.tree)  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"another user cannot run {sys.executable} and its packages: {probe.stderr.strip()[-300:]}")
        yield found
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)  # its own group goes with it
        if made_group:
            subprocess.run(["groupdel", group], capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def _folder(accounts: Accounts, name: str) -> Path:
    """A folder of the daemon's user for one daemon's config, cache and runtime dir."""
    folder = accounts.base / name
    folder.mkdir()
    os.chown(folder, accounts.daemon.uid, accounts.daemon.gid)
    return folder


def _env(home: Path | str, tree: Path | None = None) -> dict[str, str]:
    """The environment of a test user's process; `tree`: where its workers import the copied packages from.

    Workers run `python -P` (nothing from the working directory), so with the checkout behind a folder other
    users cannot enter (a clone in a 0700 mktemp folder) the editable install points where they cannot read.
    """
    return {"HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1", **({"PYTHONPATH": str(tree)} if tree else {})}


@pytest.fixture(scope="module")
def daemon(accounts: Accounts) -> Iterator[Daemon]:
    """One serving daemon of the daemon's user with `socket_group` set to the client group."""
    folder = _folder(accounts, "served")
    config = {"socket_group": accounts.clients.name, "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}
    served = Daemon(folder, config, _env(folder, accounts.tree), accounts.command(accounts.daemon), accounts.tree)
    try:
        served.wait_ready(timeout=180)
        yield served
    finally:
        served.stop()


def _as(account: Account, accounts: Accounts, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python ARGV` as `account`, from the copied packages."""
    return subprocess.run([*accounts.command(account), sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=accounts.tree, env={**os.environ, **_env("/")})  # fmt: skip


def _client(account: Account, accounts: Accounts, daemon: Daemon, timeout: float) -> dict[str, Any]:
    done = _as(account, accounts, "-c", CLIENT_SCRIPT, str(daemon.runtime_dir), str(timeout),
               str(accounts.outsider.gid))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _completed(daemon: Daemon) -> int:
    count: int = daemon.status()["models"]["tiny"]["completed"]
    return count


def _expected(daemon: Daemon) -> list[list[float]]:
    with daemon.client() as client:
        y: list[list[float]] = client.infer("tiny", {"x": np.arange(16, dtype=np.float32).reshape(1, 16)})["y"].tolist()
    return y


# ---- with the users -----------------------------------------------------------------------------


@needs_root
def test_the_runtime_dir_and_the_sockets_open_to_the_group_only_what_clients_use(
    daemon: Daemon, accounts: Accounts
) -> None:
    """0750 directory and 0660 infer.sock/status.sock in the group; control.sock and the lock stay 0600."""
    run = daemon.runtime_dir
    owner, own_group, clients = accounts.daemon.uid, accounts.daemon.gid, accounts.clients.gid
    expected = {
        ".": (owner, clients, 0o750),
        CLIENT_SOCKET_NAME: (owner, clients, 0o660),
        STATUS_SOCKET_NAME: (owner, clients, 0o660),
        CONTROL_SOCKET_NAME: (owner, own_group, 0o600),
        "infervisor.lock": (owner, own_group, 0o600),
    }
    assert sorted(p.name for p in run.iterdir()) == sorted(set(expected) - {"."})
    for name, want in expected.items():
        info = (run / name).lstat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == want, name
    for name in (CLIENT_SOCKET_NAME, STATUS_SOCKET_NAME, CONTROL_SOCKET_NAME):
        assert stat.S_ISSOCK((run / name).lstat().st_mode), name


@needs_root
def test_a_client_in_the_group_is_served_by_frames_and_by_shared_memory(daemon: Daemon, accounts: Accounts) -> None:
    """A user in the group connects, is served a request, and a 0640 shared-memory input of the group is read."""
    before = _completed(daemon)
    out = _client(accounts.member, accounts, daemon, timeout=30)
    expected = _expected(daemon)
    assert out["connect"] == 0
    assert out["frames"] == {"y": expected}
    assert out["shm_object"] == [accounts.member.uid, accounts.clients.gid, 0o640]
    assert out["shm"] == {"y": expected}
    # Its own object (its uid, its primary group, 0600) is not the daemon's to read, even through the group.
    assert out["own"]["code"] == "INVALID_INPUT", out["own"]
    assert (
        f"belongs to uid {accounts.member.uid}, not to the daemon's user (uid {accounts.daemon.uid})"
        in (out["own"]["message"])
    )
    assert f"nor to the client group (gid {accounts.clients.gid})" in out["own"]["message"]
    # A group the client is not in cannot be given the object: the kernel refuses the fchown.
    assert "cannot give the shared-memory object to group" in out["other_group"]
    assert _completed(daemon) == before + 3  # frames, shared memory, and the expected reply asked as root


@needs_root
def test_a_client_outside_the_group_is_refused_by_the_kernel(daemon: Daemon, accounts: Accounts) -> None:
    """A user outside the group: connect() gets EACCES; the ZeroMQ client is not told and sees only a TIMEOUT."""
    before = _completed(daemon)
    out = _client(accounts.outsider, accounts, daemon, timeout=2)
    assert out["connect"] == errno.EACCES
    # libzmq retries the refused connection in the background: the request is never sent.
    assert out["frames"] == {"code": "TIMEOUT", "message": "no reply within 2.000 s"}
    assert "shm" not in out
    assert _completed(daemon) == before


@needs_root
def test_the_cli_gives_group_members_status_but_not_the_operator_commands(daemon: Daemon, accounts: Accounts) -> None:
    """As a member, status --check and infer work through status.sock; restart is refused saying whose it is."""
    run = str(daemon.runtime_dir)
    check = _as(accounts.member, accounts, "-m", "infervisor", "status", "--check", "--runtime-dir", run)
    assert check.returncode == 0 and check.stdout.startswith("ready"), check.stdout + check.stderr
    infer = _as(accounts.member, accounts, "-m", "infervisor", "infer", "--runtime-dir", run, "--model", "tiny",
                "--random", "--json")  # fmt: skip
    assert infer.returncode == 0 and json.loads(infer.stdout)["model"] == "tiny", infer.stdout + infer.stderr
    pid = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
    restart = _as(accounts.member, accounts, "-m", "infervisor", "restart", "--runtime-dir", run)
    assert restart.returncode == 2, restart.stderr
    assert restart.stderr.strip() == (
        f"infervisor restart: permission denied on {run}/control.sock: operator commands (restart, reload, profile) "
        f"are for the daemon's user; run them as {accounts.daemon.name} (sudo -u {accounts.daemon.name} "
        "infervisor ...) or as root"
    )
    outside = _as(accounts.outsider, accounts, "-m", "infervisor", "status", "--runtime-dir", run)
    assert outside.returncode == 2
    assert outside.stderr.strip() == (
        f"infervisor status: permission denied on {run}/control.sock: {run} admits only the daemon's user and, "
        "when its config sets `socket_group`, that group's members (docs/deploy.md: The user and the groups)"
    )
    assert daemon.status()["models"]["tiny"]["workers"][0]["pid"] == pid, "nothing was restarted"


@needs_root
def test_status_sock_answers_read_only_commands_and_refuses_the_rest(daemon: Daemon, accounts: Accounts) -> None:
    """On status.sock ping and status are answered; restart and reload get a refusal naming control.sock."""
    pid = daemon.status()["models"]["tiny"]["workers"][0]["pid"]
    generation = daemon.status()["config"]["generation"]
    context: zmq.Context[Any] = zmq.Context.instance()
    with context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"ipc://{daemon.runtime_dir / STATUS_SOCKET_NAME}")

        def ask(command: dict[str, Any]) -> dict[str, Any]:
            socket.send_multipart([b"", pack(command)])
            assert socket.poll(10_000), f"no answer to {command}"
            answer: dict[str, Any] = unpack(socket.recv_multipart()[-1])
            return answer

        assert ask({"cmd": "ping"})["ok"] is True
        assert ask({"cmd": "status"})["state"] == "ready"
        for name in ("restart", "reload", "profile"):
            refused = ask({"cmd": name, "model": "tiny", "requests": 1})
            assert refused == {
                "ok": False,
                "error": f"'{name}' is not answered on status.sock, which takes only metrics, ping, status: send it "
                f"to control.sock as the daemon's user (sudo -u {accounts.daemon.name} infervisor ...) or as root",
            }
    status = daemon.status()
    assert status["models"]["tiny"]["workers"][0]["pid"] == pid and status["config"]["generation"] == generation


@needs_root
def test_a_second_daemon_refused_by_the_lock_leaves_the_first_ones_directory_open(
    daemon: Daemon, accounts: Accounts
) -> None:
    """A daemon without socket_group on the same runtime dir exits 78 and does not close the directory to clients."""
    config = daemon.tmp / "second.json"
    config.write_text(json.dumps({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}))
    second = _as(accounts.daemon, accounts, "-m", "infervisor", "serve", "--config", str(config),
                 "--runtime-dir", str(daemon.runtime_dir), timeout=60)  # fmt: skip
    assert second.returncode == 78
    assert "another infervisor" in second.stdout, second.stdout[-2000:]
    info = daemon.runtime_dir.stat()
    assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (accounts.clients.gid, 0o750)
    assert _client(accounts.member, accounts, daemon, timeout=30)["connect"] == 0


def _events(output: str) -> list[dict[str, Any]]:
    events = []
    for line in output.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


@needs_root
def test_a_group_the_daemons_user_is_not_in_is_a_config_error(accounts: Accounts) -> None:
    """socket_group naming a group the daemon's user cannot give files to: exit 78 before any socket or lock."""
    folder = _folder(accounts, "not-a-member")
    config = folder / "config.json"
    group = accounts.outsider.name  # the outsider's own group, made by useradd --user-group
    config.write_text(json.dumps({"socket_group": group, "models": {"tiny": model_entry({"builtin": "tiny"},
                                                                                       TINY_INPUTS)}}))  # fmt: skip
    run = folder / "run"
    done = _as(accounts.daemon, accounts, "-m", "infervisor", "serve", "--config", str(config), "--runtime-dir",
               str(run), timeout=60)  # fmt: skip
    assert done.returncode == 78, done.stdout[-2000:]
    refusal = next(e for e in _events(done.stdout) if e.get("event") == "config_invalid")
    gid = grp.getgrnam(group).gr_gid
    assert refusal["problems"] == [
        f"socket_group: the daemon's user (uid {accounts.daemon.uid}) is not a member of group {group} (gid {gid}) "
        f"and not root, so it may not give files to it; add the user to the group (usermod -aG {group} USER; "
        "under systemd, systemd/infervisor.sysusers does) and start the daemon again"
    ]
    assert list(run.iterdir()) == [], "refused before the lock and the sockets"


# ---- without users ------------------------------------------------------------------------------


def _config_text(socket_group: object) -> str:
    model = model_entry({"builtin": "tiny"}, TINY_INPUTS)
    return json.dumps({"socket_group": socket_group, "models": {"tiny": model}})


def test_a_socket_group_that_does_not_exist_is_a_config_error() -> None:
    """A group name the group database does not know is refused when the config is read, saying what to do."""
    name = f"infervisor-no-such-group-{secrets.token_hex(3)}"
    with pytest.raises(ConfigError) as caught:
        parse_config(_config_text(name), Path("."))
    assert caught.value.problems == [
        f"socket_group: no group named {name!r} on this box; create it (groupadd --system {name}, or with "
        "systemd/infervisor.sysusers) or give a numeric gid"
    ]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (True, "must be a group name, a numeric gid or null, got True"),
        ("", "must be a group name, a numeric gid or null, got ''"),
        ([0], "must be a group name, a numeric gid or null, got [0]"),
        (-1, f"gid -1 is out of range 0..{MAX_GID}"),
        (2**32 - 1, f"gid {2**32 - 1} is out of range 0..{MAX_GID}"),
    ],
)
def test_a_socket_group_is_a_name_or_a_gid(value: object, problem: str) -> None:
    """Booleans, empty names, other JSON types and gids chown(2) cannot take are refused."""
    with pytest.raises(ConfigError) as caught:
        parse_config(_config_text(value), Path("."))
    assert caught.value.problems == [f"socket_group: {problem}"]


def test_a_gid_is_taken_with_or_without_a_name() -> None:
    """A numeric gid is used as it is (a pod's supplementalGroups need no name); a known one keeps its name."""
    unnamed = next(gid for gid in range(40_000, 60_000) if gid not in {g.gr_gid for g in grp.getgrall()})
    assert parse_config(_config_text(unnamed), Path(".")).socket_group == SocketGroup(unnamed, None)
    own = os.getegid()
    assert parse_config(_config_text(own), Path(".")).socket_group == SocketGroup(own, grp.getgrgid(own).gr_name)
    assert parse_config(_config_text(None), Path(".")).socket_group is None


def test_a_region_given_to_a_group_is_never_open_to_another_one() -> None:
    """SharedRegion(group=) makes the object 0640 in that group; a mode the group cannot read is refused."""
    own = os.getegid()
    with SharedRegion(4096, group=own) as region:
        info = os.stat(os.path.join(SHM_DIR, region.name))
        assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (own, 0o640)
    with SharedRegion(4096) as private:
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, private.name)).st_mode) == 0o600
    with pytest.raises(ValueError, match="does not let group"):
        SharedRegion(4096, group=own, mode=0o600)
    name = grp.getgrgid(own).gr_name
    with SharedRegion(4096, group=name) as by_name:
        assert os.stat(os.path.join(SHM_DIR, by_name.name)).st_gid == own
    leftovers = [p for p in Path(SHM_DIR).iterdir() if p.name.startswith(f"infervisor-{os.getpid()}-")]
    assert leftovers == []


def test_without_socket_group_a_left_status_socket_is_removed(tmp_path: Path) -> None:
    """A daemon without socket_group removes a status.sock an earlier one left, so status goes to control.sock."""
    from infervisor.protocol.control_client import control_socket
    from infervisor.supervisor.core.control import ControlServer, status_server
    from infervisor.supervisor.instruments.anomalies import Anomalies

    (tmp_path / STATUS_SOCKET_NAME).write_text("")
    assert control_socket(tmp_path, {"cmd": "status"}) == tmp_path / STATUS_SOCKET_NAME
    context: zmq.Context[Any] = zmq.Context()
    try:
        assert status_server(context, tmp_path, Anomalies(), None) is None
        assert not (tmp_path / STATUS_SOCKET_NAME).exists()
        assert control_socket(tmp_path, {"cmd": "status"}) == tmp_path / CONTROL_SOCKET_NAME
        server = ControlServer(context, tmp_path, Anomalies())
        assert stat.S_IMODE((tmp_path / CONTROL_SOCKET_NAME).stat().st_mode) == 0o600
        server.close()
    finally:
        context.term()


#: Run as a client user: name a shared-memory object it did not make, then one of its own given to the group.
NAMING_SCRIPT = r"""
import json, os, sys
import numpy as np
from infervisor.protocol.client import Client
from infervisor.protocol.errors import InferenceError
from infervisor.protocol.shared_memory import SharedRegion, SharedTensor

run_dir, foreign = sys.argv[1], sys.argv[2]
path = os.path.join(run_dir, "infer.sock")
x = np.arange(16, dtype=np.float32).reshape(1, 16)
out = {}

def ask(client, inputs):
    try:
        return {"y": client.infer("tiny", inputs, timeout=30)["y"].tolist()}
    except InferenceError as exc:
        return {"code": str(exc.code), "message": exc.message}

with Client("ipc://" + path) as client:
    out["foreign"] = ask(client, {"x": SharedTensor(foreign, 0, np.zeros((1, 16), np.float32))})
    with SharedRegion(4096, group=os.stat(path).st_gid) as region:
        tensor = region.tensor(np.float32, (1, 16))
        tensor.array[:] = x
        out["own"] = ask(client, {"x": tensor})
print(json.dumps(out))
"""


@needs_root
def test_a_root_daemon_reads_for_a_client_only_the_objects_that_client_could_read(accounts: Accounts) -> None:
    """A root daemon: a group member naming root's 0600 object is refused; its own object given to the group is read."""
    config = {"socket_group": accounts.clients.name, "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}
    folder = accounts.base / "root-daemon"
    folder.mkdir(mode=0o755)  # the member reaches the runtime dir (0750, group clients) through it
    served = Daemon(folder, config)
    secret = SharedRegion(4096)  # root's, 0600: values the member must not see through the model
    try:
        secret.tensor(np.float32, (1, 16)).array[:] = np.arange(100, 116, dtype=np.float32)
        served.wait_ready(timeout=180)
        done = _as(accounts.member, accounts, "-c", NAMING_SCRIPT, str(served.runtime_dir), secret.name)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout)
        assert out["foreign"]["code"] == "INVALID_INPUT", out["foreign"]
        assert f"is not readable by the client that named it (uid {accounts.member.uid}" in out["foreign"]["message"]
        assert "owner uid 0" in out["foreign"]["message"] and "mode 0600" in out["foreign"]["message"]
        with served.client() as client:
            expected = client.infer("tiny", {"x": np.arange(16, dtype=np.float32).reshape(1, 16)})["y"].tolist()
        assert out["own"] == {"y": expected}
    finally:
        secret.close()
        served.stop()
