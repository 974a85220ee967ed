"""Streams belong to the peer that started them (issue 54): another uid on ipc, or another CURVE key on tcp, that
reuses a client's routing id cannot step, read or end its stream, and one connection starting streams in a loop
takes only its peer's share of a model's streams.

The other uid is real: a child forked from this (root) process drops to it for good (groups, gid, uid) before it
makes its ZeroMQ context, so the daemon reads it from the kernel (SO_PEERCRED) as it would any local user's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth

from tests.conftest import ROOT, Daemon, free_loopback_port, model_entry, wait_for
from tests.slow_model import SLOW_INPUTS, write_slow_model
from tests.stream_models import FEATURES, SLEEP, reference
from tests.test_streams import chunks, leaky_entry

#: The other local user: the kernel's overflow uid (nobody on most boxes), as tests/test_shared_memory.py uses.
OTHER_ID = 65534
#: The daemon's `socket_group`, a numeric gid the other user is given as its one supplementary group.
CLIENT_GID = 47154
#: A model's streams in the shared daemon; its per-peer share is the default, half of them.
MAX_STREAMS = 8
#: Rounds of `burn` that keep root's request in flight while the other uid takes its routing id (seconds here).
ROOT_ROUNDS = 6000

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")
pytestmark = needs_root

Reply = tuple[dict[str, Any], list[bytes]]


@pytest.fixture(scope="module")
def keys() -> Iterator[Path]:
    """A folder every user may enter: the server's certificate and two authorized client certificates (a, b)."""
    base = Path(tempfile.mkdtemp(prefix="infervisor-owners-"))
    base.chmod(0o755)
    try:
        for folder in ("server", "clients", "secrets"):
            (base / folder).mkdir(mode=0o700)
        _, server_secret = zmq.auth.create_certificates(base / "server", "server")
        Path(server_secret).chmod(0o600)  # a secret key others can read is no secret (issue 54, item 1)
        for name in ("a", "b"):
            _, secret = zmq.auth.create_certificates(base / "clients", name)
            Path(secret).rename(base / "secrets" / f"{name}.key_secret")
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(keys: Path) -> Iterator[Daemon]:
    """A daemon of root: `leaky` (max_streams 8, the default per-peer share), the slow `burn`, ipc open to
    CLIENT_GID, tcp with CURVE."""
    folder = keys / "daemon"
    folder.mkdir(mode=0o755)
    burn = model_entry({"torchscript": str(write_slow_model(folder))}, SLOW_INPUTS)
    config = {
        "oversubscribe": True,
        "hang_min_s": 300,
        "socket_group": CLIENT_GID,
        "tcp_endpoint": f"tcp://127.0.0.1:{free_loopback_port()}",
        "curve": {
            "server_secret_key": str(keys / "server" / "server.key_secret"),
            "authorized_clients": str(keys / "clients"),
        },
        "models": {"leaky": leaky_entry(max_streams=MAX_STREAMS), "burn": burn},
    }
    running = Daemon(folder, config, env={"PYTHONPATH": str(ROOT)})
    try:
        running.wait_ready(timeout=180)
        yield running
    finally:
        running.stop()


def dealer(endpoint: str, routing_id: bytes, curve: tuple[Path, Path] | None = None) -> zmq.Socket[Any]:
    """A DEALER with a routing id of the client's choosing (and CURVE keys: the server's, the client's secret).

    In a context of its own, which `close` ends: a child forked while a connection's descriptor is still open
    would hold that connection open, and its routing id taken, for as long as the child lives.
    """
    socket: zmq.Socket[Any] = zmq.Context().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTING_ID, routing_id)
    if curve is not None:
        server_public, _ = zmq.auth.load_certificate(curve[0])
        public, secret = zmq.auth.load_certificate(curve[1])
        socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = server_public, public, secret or b""
    socket.connect(endpoint)
    return socket


def close(socket: zmq.Socket[Any]) -> None:
    """Close the socket and end its context: its connections' descriptors are closed when this returns."""
    socket.close()
    socket.context.term()


def send(socket: zmq.Socket[Any], request_id: int | str, stream: str, x: np.ndarray | None, **flags: bool) -> None:
    """One stream message on the raw wire: a step with `x`, or bare (start or end) without."""
    inputs = [] if x is None else [{"name": "x", "dtype": "float32", "shape": list(x.shape)}]
    header = {"v": 1, "type": "infer", "id": request_id, "model": "leaky", "inputs": inputs, "stream": stream, **flags}
    socket.send_multipart([b"", msgpack.packb(header), *([] if x is None else [x.tobytes()])])


def reply(socket: zmq.Socket[Any], timeout_s: float = 30.0) -> Reply | None:
    """The next reply's header and frames, or None when none came in time."""
    if not socket.poll(int(timeout_s * 1000)):
        return None
    frames = socket.recv_multipart()
    return msgpack.unpackb(frames[1]), frames[2:]


def ask_anew(make: Callable[[], zmq.Socket[Any]], request_id: int | str, stream: str, x: np.ndarray | None,
             **flags: bool) -> dict[str, Any]:  # fmt: skip
    """Send on a fresh socket until answered: while the daemon still holds the old connection of this routing id,
    ZeroMQ turns the new one away and the message waits for a reconnection that may not come."""
    for _ in range(10):
        socket = make()
        try:
            send(socket, request_id, stream, x, **flags)
            answer = reply(socket, 3.0)
        finally:
            close(socket)
        if answer is not None:
            return answer[0]
    raise AssertionError(f"no reply to {stream!r} on ten connections")


def as_other_uid(task: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `task` in a child that is OTHER_ID (in CLIENT_GID only) for good; what it returned, or what it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, then a ZeroMQ context of its own
        code = 1
        try:
            os.close(read_end)
            os.setgroups([CLIENT_GID])
            os.setresgid(OTHER_ID, OTHER_ID, OTHER_ID)
            os.setresuid(OTHER_ID, OTHER_ID, OTHER_ID)
            result = {"uid": os.getuid(), **task()}
            code = 0
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the parent reports it
            result = {"raised": repr(exc)}
        finally:
            os.write(write_end, json.dumps(result, default=str).encode())
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    returned: dict[str, Any] = json.loads(data)
    assert "raised" not in returned and returned["uid"] == OTHER_ID, returned
    return returned


def test_another_uid_reusing_the_routing_id_cannot_step_read_or_end_the_stream(daemon: Daemon) -> None:
    """Root runs three steps on routing id `victim` and leaves without an end; uid 65534 connects with that routing
    id, steps the stream with return_state and ends it: UNKNOWN_STREAM both times, nothing read. Root, back on its
    routing id, steps on from its own third step (the other uid's step committed nothing) and ends it."""
    inputs = chunks(54, 4)
    expected, final = reference(inputs)
    victim = dealer(daemon.endpoint, b"victim")
    try:
        for step, chunk in enumerate(inputs[:3]):
            send(victim, step, "s", chunk, start=step == 0)
            answer = reply(victim)
            assert answer is not None and answer[0]["type"] == "result", answer
    finally:
        close(victim)

    def steal() -> dict[str, Any]:
        make = lambda: dealer(daemon.endpoint, b"victim")  # noqa: E731
        stepped = ask_anew(make, 100, "s", inputs[3], return_state=True)
        ended = ask_anew(make, 101, "s", None, end=True)
        return {"stepped": stepped, "ended": ended}

    stolen = as_other_uid(steal)
    for key in ("stepped", "ended"):
        got = stolen[key]
        assert got["type"] == "error" and got["code"] == "UNKNOWN_STREAM", stolen
        assert "never started on this connection" in got["message"], got
    assert daemon.status()["models"]["leaky"]["streams"]["open"] == 1, "the stream is still open"
    back = dealer(daemon.endpoint, b"victim")
    try:
        send(back, 3, "s", inputs[3], end=True, return_state=True)
        answer = reply(back)
    finally:
        close(back)
    assert answer is not None and answer[0]["type"] == "result", answer
    # The fourth step is the reference's fourth: the stream went on from the owner's third step.
    header, frames = answer
    assert header["state"] == ["h_next"], header
    np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32).reshape(1, FEATURES), expected[3])
    np.testing.assert_array_equal(np.frombuffer(frames[1], np.float32).reshape(final.shape), final)
    assert daemon.status()["models"]["leaky"]["streams"]["open"] == 0


def test_one_connection_flooding_starts_takes_only_its_share(daemon: Daemon) -> None:
    """Root sends 12 bare starts at once on one connection: 4 open (half of max_streams 8), 8 are TOO_MANY_STREAMS
    naming the share; another uid still starts a stream. Status shows the share and two peers."""
    flood = dealer(daemon.endpoint, b"flooder")
    try:
        for index in range(12):
            send(flood, index, f"f{index}", None, start=True)
        answers = [reply(flood) for _ in range(12)]
        assert all(a is not None for a in answers), answers
        headers = [a[0] for a in answers if a is not None]
        codes = sorted(h["type"] if h["type"] == "result" else h["code"] for h in headers)
        assert codes == ["TOO_MANY_STREAMS"] * 8 + ["result"] * 4, codes
        refused = next(h for h in headers if h["type"] == "error")
        assert "uid 0 holds 4 open streams" in refused["message"] and "max_streams_per_peer 4" in refused["message"]

        make = lambda: dealer(daemon.endpoint, b"other")  # noqa: E731
        started = as_other_uid(lambda: ask_anew(make, 1, "mine", chunks(55, 1)[0], start=True))
        assert started["type"] == "result", started
        streams = daemon.status()["models"]["leaky"]["streams"]
        assert streams["open"] == 5 and streams["peers"] == 2, streams
        assert streams["max_streams_per_peer"] == MAX_STREAMS // 2, streams
        assert streams["max_state_bytes_per_peer"] == streams["max_state_bytes"] // 2, streams
        opened = [h["id"] for h in headers if h["type"] == "result"]
        for request_id in opened:
            send(flood, 100 + request_id, f"f{request_id}", None, end=True)
        assert all((a := reply(flood)) is not None and a[0]["type"] == "result" for _ in opened)
        ended = as_other_uid(lambda: ask_anew(make, 2, "mine", None, end=True))
        assert ended["type"] == "result", "the other uid, back on its routing id, ends its own stream"
    finally:
        close(flood)
    assert daemon.status()["models"]["leaky"]["streams"]["open"] == 0


def test_another_curve_key_reusing_the_routing_id_gets_unknown_stream(daemon: Daemon, keys: Path) -> None:
    """Over tcp with CURVE, key `a` starts a stream on routing id `shared` and leaves; key `b` on that routing id
    cannot step or end it; `a`, back, steps on and ends it."""
    endpoint = daemon.status()["endpoints"]["tcp"]
    server = keys / "server" / "server.key"
    as_a = lambda: dealer(endpoint, b"shared", (server, keys / "secrets" / "a.key_secret"))  # noqa: E731
    as_b = lambda: dealer(endpoint, b"shared", (server, keys / "secrets" / "b.key_secret"))  # noqa: E731
    x = chunks(56, 1)[0]
    assert ask_anew(as_a, 1, "t", x, start=True)["type"] == "result"
    for flags in ({}, {"end": True}):
        got = ask_anew(as_b, 2, "t", x if not flags else None, **flags)
        assert got["type"] == "error" and got["code"] == "UNKNOWN_STREAM", got
    assert ask_anew(as_a, 3, "t", x)["type"] == "result"
    assert ask_anew(as_a, 4, "t", None, end=True)["type"] == "result"
    assert daemon.status()["models"]["leaky"]["streams"]["open"] == 0


def test_a_reply_never_reaches_another_uid_that_took_the_routing_id(daemon: Daemon) -> None:
    """Root asks `burn` for a long run on routing id `leaver` and disconnects; uid 65534 connects with that routing id
    (proven by an answer to a request of its own) and asks `burn` for a short run, queued behind root's: it gets its
    own result and nothing else, and root's result is counted undeliverable."""
    before = daemon.status()["counters"].get("reply_undeliverable", 0)
    leaver = dealer(daemon.endpoint, b"leaver")
    burn(leaver, "root's", ROOT_ROUNDS)
    wait_for(lambda: daemon.status()["models"]["burn"]["workers"][0]["busy"], 60, "burn busy with root's request")
    close(leaver)
    taken = as_other_uid(lambda: take_over(daemon, b"leaver", lambda socket: burn(socket, "mine", 1)))
    assert taken["received"] == ["mine"], taken
    after = daemon.status()["counters"].get("reply_undeliverable", 0)
    assert after == before + 1, (before, after)


def test_a_stream_step_reply_never_reaches_another_uid_that_took_the_routing_id(daemon: Daemon) -> None:
    """The same with a stream step: root's step held 3 s in `leaky`, root gone, uid 65534 on its routing id starts a
    stream of its own behind it and gets that reply only; root, back on its routing id, ends its stream."""
    before = daemon.status()["counters"].get("reply_undeliverable", 0)
    held = np.zeros((1, FEATURES), np.float32)
    held[0, :2] = SLEEP, 3.0
    leaver = dealer(daemon.endpoint, b"stepper")
    send(leaver, "root's", "s", held, start=True)
    wait_for(lambda: daemon.status()["models"]["leaky"]["workers"][0]["busy"], 60, "leaky busy with root's step")
    close(leaver)

    def own_stream(socket: zmq.Socket[Any]) -> None:
        send(socket, "mine", "m", chunks(57, 1)[0], start=True, end=True)

    taken = as_other_uid(lambda: take_over(daemon, b"stepper", own_stream))
    assert taken["received"] == ["mine"], taken
    after = daemon.status()["counters"].get("reply_undeliverable", 0)
    assert after == before + 1, (before, after)
    ended = ask_anew(lambda: dealer(daemon.endpoint, b"stepper"), "end", "s", None, end=True)
    assert ended["type"] == "result", ended


def take_over(daemon: Daemon, routing_id: bytes, ask: Callable[[zmq.Socket[Any]], None]) -> dict[str, Any]:
    """Connect on `routing_id` once the daemon let go of its last holder (a probe is answered), `ask` a request of
    id "mine", and read replies until its own: the ids received, in order."""
    for _ in range(20):
        socket = dealer(daemon.endpoint, routing_id)
        socket.send_multipart([b"", msgpack.packb({"v": 1, "type": "infer", "id": "probe", "model": "none"})])
        if reply(socket, 2.0) is not None:
            break
        close(socket)
    else:
        raise AssertionError("the routing id was never free")
    try:
        ask(socket)
        received: list[str] = []
        while not received or received[-1] != "mine":
            got = reply(socket, 120.0)
            if got is None:
                raise AssertionError(f"no reply to its own request; received {received}")
            received.append(got[0]["id"])
        return {"received": received}
    finally:
        close(socket)


def burn(socket: zmq.Socket[Any], request_id: str, rounds: int) -> None:
    """Ask `burn` for `rounds` rounds of its matmul."""
    header = {"v": 1, "type": "infer", "id": request_id, "model": "burn",
              "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 1]}]}  # fmt: skip
    socket.send_multipart([b"", msgpack.packb(header), np.array([[float(rounds)]], np.float32).tobytes()])
