"""Real faults against a real daemon: kill -9, SIGSTOP, poison requests, crash loops, floods, memory bombs."""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.protocol.client_messages import InferRequest, encode_infer
from infervisor.protocol.tensors import TensorDesc
from infervisor.supervisor.host.topology import parse_cpu_list
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for
from tests.fault_models import ALLOCATE, ECHO, FAULT_INPUTS, GARBLE, SEGFAULT, SLEEP, command

FAULTY = {"python": "tests.fault_models:faulty"}
FAST_LIVENESS = {"heartbeat_interval_ms": 100, "heartbeat_liveness": 5, "hang_min_s": 1.5}


def _workers(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = daemon.status()["models"][model]["workers"]
    return workers


def _serving_pids(daemon: Daemon, model: str) -> set[int]:
    return {w["pid"] for w in _workers(daemon, model) if w["state"] == "serving"}


class RawClient(threading.Thread):
    """Sends numbered requests one after another on its own DEALER and records every reply it gets.

    It sends `count` requests, or with `count` None keeps sending until `stop` is set.
    """

    def __init__(self, endpoint: str, count: int | None, payload: dict[str, np.ndarray]) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.count, self.payload = endpoint, count, payload
        self.replies: dict[int, list[dict[str, Any]]] = {}
        self.sent = 0
        self.stop = threading.Event()

    def run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint)
        ((name, array),) = self.payload.items()
        desc = (TensorDesc(name, "float32", tuple(array.shape)),)
        try:
            request_id = 0
            while (request_id < self.count) if self.count is not None else not self.stop.is_set():
                socket.send_multipart([b"", encode_infer(InferRequest(request_id, "faulty", desc)), array])
                request_id += 1
                self.sent = request_id
                if not socket.poll(60_000):
                    return
                self._record(socket.recv_multipart())
            # Anything more that arrives now would be a second reply to some request.
            while socket.poll(500):
                self._record(socket.recv_multipart())
        finally:
            socket.close()

    def _record(self, frames: list[bytes]) -> None:
        header = msgpack.unpackb(frames[1])
        self.replies.setdefault(header["id"], []).append(header)


def test_kill9_of_busy_workers_loses_no_request(start_daemon: Callable[..., Daemon]) -> None:
    """Every request of four clients gets exactly one result while busy workers are killed with SIGKILL."""
    daemon = start_daemon(
        {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, workers=2)}, "oversubscribe": True},
        env={"PYTHONPATH": str(ROOT)},
    )
    daemon.wait_ready()
    # The clients keep the workers busy until both kills have landed, however long replacements take to start.
    clients = [RawClient(daemon.endpoint, None, command(SLEEP, 0.1)) for _ in range(4)]
    for client in clients:
        client.start()
    for _ in range(2):
        busy = wait_for(lambda: [w for w in _workers(daemon, "faulty") if w["busy"]], 30, "a busy worker")
        os.kill(busy[0]["pid"], signal.SIGKILL)
        wait_for(
            lambda pid=busy[0]["pid"]: (
                pid not in _serving_pids(daemon, "faulty") and len(_serving_pids(daemon, "faulty")) == 2
            ),
            60,
            "replacement serving",
        )
    for client in clients:
        client.stop.set()
    for client in clients:
        client.join(120)
    for client in clients:
        assert client.sent > 0 and sorted(client.replies) == list(range(client.sent)), "a request got no reply"
        assert all(len(r) == 1 for r in client.replies.values()), "a request got two replies"
        assert all(r[0]["type"] == "result" for r in client.replies.values())
    assert sum(w["restarts"] for w in _workers(daemon, "faulty")) == 2
    assert any(e["event"] == "request_redispatched" for e in daemon.log_events())


def test_stopped_idle_and_busy_workers_are_detected_and_replaced(start_daemon: Callable[..., Daemon]) -> None:
    """A SIGSTOPped worker is found by missed heartbeats (idle) or no progress (busy), replaced, its request re-run."""
    daemon = start_daemon(
        {**FAST_LIVENESS, "models": {"faulty": model_entry(FAULTY, FAULT_INPUTS)}}, env={"PYTHONPATH": str(ROOT)}
    )
    first = daemon.wait_ready()["models"]["faulty"]["workers"][0]["pid"]
    os.kill(first, signal.SIGSTOP)
    second = wait_for(
        lambda: (_serving_pids(daemon, "faulty") - {first}) or None, 30, "idle hung worker replaced"
    ).pop()
    kills = [e for e in daemon.log_events() if e["event"] == "worker_killed"]
    assert kills and "no heartbeat" in kills[0]["reason"]
    with daemon.client() as client:
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(client.infer("faulty", command(SLEEP, 0.5), timeout=60)))
        thread.start()
        wait_for(lambda: _workers(daemon, "faulty")[0]["busy"], 30, "worker busy")
        os.kill(second, signal.SIGSTOP)
        thread.join(60)
    assert result["output"].shape == (1, 2), "the request of the hung worker was re-dispatched and answered"
    assert second not in _serving_pids(daemon, "faulty")
    assert any("hung" in e.get("reason", "") for e in daemon.log_events() if e["event"] == "worker_killed")


def test_poison_request_costs_k_plus_one_workers_then_worker_lost(start_daemon: Callable[..., Daemon]) -> None:
    """A request that segfaults every worker is tried max_retries+1 times, then WORKER_LOST; the pool serves on."""
    config = {"oversubscribe": True, "models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, workers=2, max_retries=2)}}
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    daemon.wait_ready()
    with daemon.client() as client:
        with pytest.raises(InferenceError) as caught:
            client.infer("faulty", command(SEGFAULT), timeout=120)
        assert caught.value.code == ErrorCode.WORKER_LOST
        assert "lost 3 workers" in caught.value.message
        wait_for(lambda: len(_serving_pids(daemon, "faulty")) == 2, 60, "pool back to two workers")
        assert client.infer("faulty", command(ECHO, 7.0), timeout=30)["output"][0, 1] == 7.0
    deaths = [e for e in daemon.log_events() if e["event"] == "worker_exited"]
    assert len(deaths) == 3 and all("SIGSEGV" in e["how"] for e in deaths)


def test_a_worker_that_garbles_its_link_is_replaced(start_daemon: Callable[..., Daemon]) -> None:
    """Broken framing on a worker's link is counted, that worker is killed and its request lost; a new one serves."""
    config = {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, max_retries=0)}}
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    pid = daemon.wait_ready()["models"]["faulty"]["workers"][0]["pid"]
    with daemon.client() as client:
        with pytest.raises(InferenceError) as caught:
            client.infer("faulty", command(GARBLE), timeout=60)
        assert caught.value.code == ErrorCode.WORKER_LOST
        wait_for(lambda: len(_serving_pids(daemon, "faulty") - {pid}) == 1, 60, "a new worker serving")
        assert client.infer("faulty", command(ECHO, 4.0), timeout=30)["output"][0, 1] == 4.0
    assert daemon.status()["counters"]["worker_message_malformed"] == 1
    (killed,) = [e for e in daemon.log_events() if e["event"] == "worker_killed"]
    assert killed["pid"] == pid and "garbled link" in killed["reason"]


def test_crash_loop_backs_off_then_fails_and_the_daemon_stays_down(start_daemon: Callable[..., Daemon]) -> None:
    """A model that fails to load differently each time is retried with growing delays, then FAILED; with nothing
    left serving the daemon stays up, state down, for a fixed config."""
    config = {
        "max_restarts": 3,
        "models": {"broken": model_entry({"python": "tests.fault_models:unsteady"}, FAULT_INPUTS)},
    }
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    wait_for(lambda: daemon.try_status() and daemon.status()["state"] == "down", 120, "the daemon down")
    events = daemon.log_events()
    states = [e for e in events if e["event"] == "worker_state"]
    backoffs = [e["reason"] for e in states if e["new"] == "backoff"]
    failed = [e["reason"] for e in states if e["new"] == "failed"]
    # Three starts: the first two exits back off, the third one fails the slot for good.
    assert len(backoffs) == 2 and all("LOAD_FAILED" in r and "download interrupted" in r for r in backoffs)
    assert len(failed) == 1 and "3 failures" in failed[0] and "LOAD_FAILED" in failed[0]
    delays = [float(r.split("respawn in ")[1].split(" s")[0]) for r in backoffs]
    assert delays[0] < delays[1], "back-off must grow"
    assert any(e["event"] == "worker_slot_failed" for e in events)
    assert any(e["event"] == "all_workers_failed" for e in events)
    assert daemon.process.poll() is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cpus")
def test_replacement_worker_gets_the_same_cores_and_threads(start_daemon: Callable[..., Daemon]) -> None:
    """After kill -9, the new worker of the slot is pinned to the slot's cores with the planned thread count."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=2)}})
    before = {w["slot"]: w for w in daemon.wait_ready()["models"]["tiny"]["workers"]}
    os.kill(before[1]["pid"], signal.SIGKILL)
    wait_for(
        lambda: before[1]["pid"] not in _serving_pids(daemon, "tiny") and len(_serving_pids(daemon, "tiny")) == 2,
        60,
        "replacement",
    )
    after = {w["slot"]: w for w in _workers(daemon, "tiny")}
    replacement = after[1]
    status_text = Path(f"/proc/{replacement['pid']}/status").read_text()
    allowed = next(
        line.split(":", 1)[1].strip() for line in status_text.splitlines() if line.startswith("Cpus_allowed_list")
    )
    assert set(parse_cpu_list(allowed)) == set(before[1]["cores"]) == set(replacement["cores"])
    assert replacement["threads"] == before[1]["threads"] == len(before[1]["cores"])
    assert replacement["restarts"] == 1 and after[0]["pid"] == before[0]["pid"]


def test_flood_is_answered_overloaded_at_once_and_broker_memory_stays_bounded(
    start_daemon: Callable[..., Daemon],
) -> None:
    """1,000 requests of 256 KB at once against a queue of 8 get OVERLOADED replies; the broker's RSS stays bounded."""
    config = {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, queue_size=8)}}
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    daemon.wait_ready()
    broker = psutil.Process(daemon.process.pid)
    rss_before = broker.memory_info().rss
    payload = np.zeros((32768, 2), np.float32)
    payload[0] = (SLEEP, 0.05)
    desc = (TensorDesc("x", "float32", payload.shape),)
    peak = rss_before
    sockets = []
    codes: dict[str, int] = {}
    for _ in range(20):
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(daemon.endpoint)
        sockets.append(socket)
    try:
        for request_id in range(50):
            for socket in sockets:
                socket.send_multipart(
                    [b"", encode_infer(InferRequest(request_id, "faulty", desc)), payload], copy=False
                )
            peak = max(peak, broker.memory_info().rss)
        received = 0
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        while received < 1000:
            ready = dict(poller.poll(60_000))
            assert ready, f"only {received} of 1000 replies"
            for socket in ready:
                header = msgpack.unpackb(socket.recv_multipart()[1])
                code = header.get("code", "OK")
                codes[code] = codes.get(code, 0) + 1
                received += 1
            peak = max(peak, broker.memory_info().rss)
    finally:
        for socket in sockets:
            socket.close()
    assert set(codes) <= {"OK", "OVERLOADED"}
    assert codes["OVERLOADED"] >= 900
    assert peak - rss_before < 150 * 2**20, f"broker grew {(peak - rss_before) / 2**20:.0f} MB under 256 MB offered"


def test_runtime_dir_and_sockets_are_private(start_daemon: Callable[..., Daemon]) -> None:
    """The runtime directory is 0700, and the sockets and the one-daemon lock file in it 0600."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    assert stat.S_IMODE(daemon.runtime_dir.stat().st_mode) == 0o700
    for name in ("infer.sock", "control.sock", "infervisor.lock"):
        assert stat.S_IMODE((daemon.runtime_dir / name).stat().st_mode) == 0o600
    # Workers reach the supervisor through inherited socketpairs: there is nothing in the directory to connect to.
    assert sorted(p.name for p in daemon.runtime_dir.iterdir()) == ["control.sock", "infer.sock", "infervisor.lock"]


def _connect_as(uid: int, path: Path) -> int:
    """Connect to a unix socket from a child running as `uid`; returns 0 if it connected, else the errno."""
    pid = os.fork()
    if pid == 0:  # the child only switches user and makes one syscall, then leaves without cleanup
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(path))
            code = 0
        except OSError as exc:
            code = exc.errno or 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_sockets(start_daemon: Callable[..., Daemon]) -> None:
    """uid 65534 is refused at the 0700 runtime dir (and at the 0600 socket), while the daemon's own uid connects."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    # Open every folder above the runtime dir, so that only the daemon's own permissions stand in the way.
    for folder in daemon.runtime_dir.parents:
        if str(folder).startswith(str(daemon.tmp.parent.parent)):
            folder.chmod(folder.stat().st_mode | 0o005)
    socket_path = daemon.runtime_dir / "infer.sock"
    assert _connect_as(os.geteuid(), socket_path) == 0
    assert _connect_as(65534, socket_path) == errno.EACCES
    daemon.runtime_dir.chmod(0o755)  # even with the directory open, the socket's own 0600 refuses
    try:
        assert _connect_as(65534, socket_path) == errno.EACCES
    finally:
        daemon.runtime_dir.chmod(0o700)
    assert daemon.status()["models"]["tiny"]["completed"] == 0


def test_memory_bomb_request_is_an_error_and_the_worker_survives(start_daemon: Callable[..., Daemon]) -> None:
    """With max_memory_mb set, a request that allocates 8 GiB fails inside torch; the same worker keeps serving."""
    config = {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, max_memory_mb=2048)}}
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    pid = daemon.wait_ready()["models"]["faulty"]["workers"][0]["pid"]
    with daemon.client() as client:
        with pytest.raises(InferenceError) as caught:
            client.infer("faulty", command(ALLOCATE, 8.0), timeout=60)
        assert caught.value.code == ErrorCode.INTERNAL
        assert "allocate" in caught.value.message.lower()
        assert client.infer("faulty", command(ECHO, 3.0), timeout=30)["output"][0, 1] == 3.0
    assert _serving_pids(daemon, "faulty") == {pid}


def test_an_inference_longer_than_the_heartbeat_window_is_not_mistaken_for_a_lost_supervisor(
    start_daemon: Callable[..., Daemon],
) -> None:
    """A 2 s request with a 0.5 s liveness window finishes, and the worker stays (its heartbeats were only queued)."""
    config = {
        "heartbeat_interval_ms": 100,
        "heartbeat_liveness": 5,
        "hang_min_s": 30,
        "models": {"faulty": model_entry(FAULTY, FAULT_INPUTS)},
    }
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    pid = daemon.wait_ready()["models"]["faulty"]["workers"][0]["pid"]
    with daemon.client() as client:
        assert client.infer("faulty", command(SLEEP, 2.0), timeout=60)["output"].shape == (1, 2)
        assert client.infer("faulty", command(ECHO, 1.0), timeout=30)["output"][0, 1] == 1.0
    assert _serving_pids(daemon, "faulty") == {pid}
    assert not [e for e in daemon.log_events() if e["event"] in ("supervisor_lost", "worker_exited")]
