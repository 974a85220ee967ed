"""Inputs in POSIX shared memory: the descriptor rules, the client's region, the worker's reader and a live daemon."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.protocol import ErrorCode, InferenceError, SharedRegion
from infervisor.protocol.client import Client
from infervisor.protocol.client_messages import InferRequest, decode_infer, encode_infer
from infervisor.protocol.constants import SHM_DIR
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.shared_memory import SharedTensor
from infervisor.protocol.tensors import ShmRef, TensorDesc, check_frames, parse_descs
from infervisor.worker.models import build_builtin
from infervisor.worker.shared_inputs import SharedInputs
from tests.conftest import ENCODER_INPUTS, IMAGE_INPUTS, ROOT, Daemon, free_loopback_port, model_entry, wait_for

IMAGE = (1, 3, 224, 224)

#: A uid and gid that are not the test's (the kernel's overflow ids: nobody and nogroup on most boxes).
OTHER_ID = 65534
#: The requesting client as the broker gives it to the worker: uid, gid, groups (this test's, and the other id's).
ME = [os.geteuid(), os.getegid()]
OTHER = [OTHER_ID, OTHER_ID]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")


def _desc(name: str = "x", shape: tuple[int, ...] = (2, 4), shm: Any = None) -> dict[str, Any]:
    wire: dict[str, Any] = {"name": name, "dtype": "float32", "shape": list(shape)}
    if shm is not None:
        wire["shm"] = shm
    return wire


@pytest.fixture
def region() -> Iterator[SharedRegion]:
    """A fresh 1 MiB region, unlinked at teardown."""
    with SharedRegion(2**20) as made:
        yield made


# ---- the descriptor ----------------------------------------------------------------------------


def test_an_input_descriptor_may_point_into_shared_memory_and_keeps_its_frame_order() -> None:
    """`shm` parses to a ShmRef that to_wire gives back; frames are counted for the other inputs only."""
    descs = parse_descs([_desc("a"), _desc("b", shm={"name": "cam-0.f32", "offset": 4096})], allow_shm=True)
    assert descs[1].shm == ShmRef("cam-0.f32", 4096)
    assert parse_descs([d.to_wire() for d in descs], allow_shm=True) == descs
    check_frames(descs, [32], 1024)
    with pytest.raises(ProtocolError, match="describes 1 tensors in frames but 2 frames follow"):
        check_frames(descs, [32, 32], 1024)


@pytest.mark.parametrize(
    ("shm", "needle"),
    [
        ("cam", "must be a map"),
        ({"name": "../etc/passwd", "offset": 0}, "must match"),
        ({"name": "a/b", "offset": 0}, "must match"),
        ({"name": ".hidden", "offset": 0}, "must match"),
        ({"name": "x" * 201, "offset": 0}, "must match"),
        ({"name": 7, "offset": 0}, "must match"),
        ({"name": "cam", "offset": -1}, "offset must be"),
        ({"name": "cam", "offset": True}, "offset must be"),
        ({"name": "cam", "offset": 2**60}, "offset must be"),
        ({"name": "cam"}, "offset must be"),
    ],
)
def test_a_bad_shared_memory_reference_is_a_bad_request(shm: Any, needle: str) -> None:
    """Names that could leave /dev/shm, and offsets that are not small non-negative integers, are refused."""
    with pytest.raises(ProtocolError, match=needle) as caught:
        parse_descs([_desc(shm=shm)], allow_shm=True)
    assert caught.value.code == ErrorCode.BAD_REQUEST


def test_outputs_and_oversized_inputs_cannot_use_shared_memory() -> None:
    """Only inputs may lie in shared memory, and the frame size limit holds for them too."""
    with pytest.raises(ProtocolError, match="cannot lie in shared memory"):
        parse_descs([_desc(shm={"name": "cam", "offset": 0})], "outputs")
    header = encode_infer(InferRequest(1, "m", (TensorDesc("x", "float32", (1024,), ShmRef("cam", 0)),)))
    assert decode_infer(header, [], 4096).inputs[0].shm == ShmRef("cam", 0)
    with pytest.raises(ProtocolError, match="is 4096 bytes, limit 4095") as caught:
        decode_infer(header, [], 4095)
    assert caught.value.code == ErrorCode.INVALID_INPUT


# ---- the client's region -----------------------------------------------------------------------


def test_a_region_is_a_private_dev_shm_file_that_close_unlinks(region: SharedRegion) -> None:
    """The object is /dev/shm/NAME with mode 0600 and the asked size; tensors are aligned views of it."""
    path = Path(SHM_DIR) / region.name
    info = path.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_size) == (0o600, 2**20)
    first = region.tensor(np.float32, (3,))
    second = region.tensor(np.int64, (2, 2))
    assert (first.offset, second.offset) == (0, 64)
    second.array[:] = 7
    assert np.frombuffer(path.read_bytes()[64:96], np.int64).tolist() == [7, 7, 7, 7]
    with pytest.raises(ValueError, match="do not fit"):
        region.tensor(np.float32, (2**20,))
    region.close()
    assert not path.exists()
    assert second.array.tolist() == [[7, 7], [7, 7]]  # the mapping outlives the name while views need it


_FULL_SHM_SCRIPT = """
import errno, os
from infervisor.protocol import SharedRegion
try:
    SharedRegion(1 << 20)
except OSError as exc:
    print("raised", exc.errno == errno.ENOSPC, exc)
    print("left", os.listdir("/dev/shm"))
else:
    print("created")
"""


def test_a_region_that_dev_shm_cannot_hold_raises_instead_of_killing_the_writer_later() -> None:
    """On a 64 kB /dev/shm (a private mount namespace), a 1 MiB region raises ENOSPC, naming the free space."""
    command = [
        "unshare", "-m", "--propagation", "private", "sh", "-c",
        f'mount -t tmpfs -o size=64k tmpfs {SHM_DIR} && exec "$0" -c "$1"', sys.executable, _FULL_SHM_SCRIPT,
    ]  # fmt: skip
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    expected = "raised True [Errno 28] no space left on device for a 1048576-byte shared-memory region"
    assert expected in result.stdout, result
    assert "bytes free" in result.stdout and "left []" in result.stdout, result.stdout


def test_a_region_refuses_a_taken_name_and_a_name_the_daemon_would_refuse(region: SharedRegion) -> None:
    """Creating never opens another process's object, and never makes a name no worker will read."""
    with pytest.raises(FileExistsError):
        SharedRegion(64, name=region.name)
    with pytest.raises(ValueError, match="must match"):
        SharedRegion(64, name="a/b")


# ---- the worker's reader -----------------------------------------------------------------------


def test_the_reader_copies_the_bytes_and_reuses_its_buffer_only_when_nothing_holds_it(region: SharedRegion) -> None:
    """A read copies what is there now; a tensor still viewing the last buffer makes the next read use a new one."""
    tensor = region.tensor(np.float32, (2, 4))
    tensor.array[:] = np.arange(8).reshape(2, 4)
    desc = TensorDesc("x", "float32", (2, 4), ShmRef(region.name, tensor.offset))
    shared = SharedInputs()
    first = shared.read(desc, ME)
    assert np.frombuffer(first, np.float32).tolist() == list(range(8))
    first_id = id(first)
    del first
    tensor.array[:] = -1
    second = shared.read(desc, ME)
    assert id(second) == first_id
    assert np.frombuffer(second, np.float32).tolist() == [-1.0] * 8
    held = torch.frombuffer(second, dtype=torch.float32)
    del second
    third = shared.read(desc, ME)
    assert id(third) != first_id
    assert held.tolist() == [-1.0] * 8


def test_the_reader_refuses_what_it_cannot_or_must_not_read(region: SharedRegion, tmp_path: Path) -> None:
    """Missing, too short, a symlink or a FIFO: each an INVALID_INPUT that says which."""
    name = f"infervisor-test-{os.getpid()}"
    cases = {
        "does not exist": TensorDesc("x", "float32", (4,), ShmRef(name + "-none", 0)),
        f"is {2**20} bytes; float32[4] at offset {2**20 - 8} needs {2**20 + 8}": TensorDesc(
            "x", "float32", (4,), ShmRef(region.name, 2**20 - 8)
        ),
    }
    link, fifo = Path(SHM_DIR) / (name + "-link"), Path(SHM_DIR) / (name + "-fifo")
    link.symlink_to(Path(SHM_DIR) / region.name)
    os.mkfifo(fifo)
    try:
        cases["is a symbolic link"] = TensorDesc("x", "float32", (4,), ShmRef(link.name, 0))
        cases["is not a regular file"] = TensorDesc("x", "float32", (4,), ShmRef(fifo.name, 0))
        for needle, desc in cases.items():
            with pytest.raises(ProtocolError) as caught:
                SharedInputs().read(desc, ME)
            assert caught.value.code == ErrorCode.INVALID_INPUT
            assert needle in caught.value.message
    finally:
        link.unlink()
        fifo.unlink()


# ---- a live daemon -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """resnet18 and the encoder, one worker each, on ipc and on a loopback tcp endpoint."""
    config = {
        "oversubscribe": True,
        "tcp_endpoint": f"tcp://127.0.0.1:{free_loopback_port()}",
        "models": {
            "resnet18": model_entry({"builtin": "resnet18"}, IMAGE_INPUTS),
            "encoder": model_entry({"builtin": "encoder"}, ENCODER_INPUTS),
        },
    }
    started = Daemon(tmp_path_factory.mktemp("shm"), config)
    try:
        started.wait_ready(timeout=180)
        yield started
    finally:
        assert started.stop() == 0, started.log_text()[-3000:]


def _worker_pids(daemon: Daemon) -> dict[str, list[int]]:
    models = daemon.status()["models"]
    return {name: [w["pid"] for w in model["workers"]] for name, model in models.items()}


def test_inputs_in_shared_memory_give_the_in_process_outputs(daemon: Daemon, region: SharedRegion) -> None:
    """resnet18 from a region, and the encoder with ids in a region and the mask in a frame, equal eager runs."""
    rng = np.random.default_rng(5)
    image = region.tensor(np.float32, IMAGE)
    image.array[:] = rng.standard_normal(IMAGE, dtype=np.float32)
    ids = region.tensor(np.int64, (2, 128))
    ids.array[:] = rng.integers(0, 30522, size=(2, 128))
    mask = np.ones((2, 128), np.int64)
    mask[1, 90:] = 0
    torch.set_num_threads(1)
    with Client(daemon.endpoint) as client, torch.inference_mode():
        logits = client.infer("resnet18", {"image": image})["logits"]
        expected = build_builtin("resnet18").eval()(torch.from_numpy(image.array.copy()))
        np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-4, atol=1e-5)
        assert np.array_equal(logits, client.infer("resnet18", {"image": image.array.copy()})["logits"])
        embedding = client.infer("encoder", {"input_ids": ids, "attention_mask": mask})["embedding"]
        expected = build_builtin("encoder").eval()(torch.from_numpy(ids.array.copy()), torch.from_numpy(mask))
        np.testing.assert_allclose(embedding, expected.numpy(), rtol=1e-4, atol=1e-5)
        # The worker reads the region per request: new contents, new answer.
        image.array[:] = 0.5
        again = client.infer("resnet18", {"image": image})["logits"]
        assert np.array_equal(again, client.infer("resnet18", {"image": np.full(IMAGE, 0.5, np.float32)})["logits"])


def test_an_unreadable_region_is_an_error_reply_and_the_worker_serves_on(daemon: Daemon, region: SharedRegion) -> None:
    """A region that is gone, or too short for the tensor, costs that request only; the same worker answers next."""
    before = _worker_pids(daemon)
    image = region.tensor(np.float32, IMAGE)
    image.array[:] = 1.0
    with Client(daemon.endpoint) as client, SharedRegion(1024) as short:
        for bad, needle in (
            (SharedTensor(short.name, 0, image.array), "is 1024 bytes"),
            (SharedTensor(f"infervisor-gone-{os.getpid()}", 0, image.array), "does not exist"),
        ):
            with pytest.raises(InferenceError, match=needle) as caught:
                client.infer("resnet18", {"image": bad}, timeout=10)
            assert caught.value.code == ErrorCode.INVALID_INPUT
        assert client.infer("resnet18", {"image": image}, timeout=10)["logits"].shape == (1, 1000)
    assert _worker_pids(daemon) == before


def test_shared_memory_is_refused_on_the_tcp_endpoint(daemon: Daemon, region: SharedRegion) -> None:
    """A tcp client may be on another box: naming a region there is a bad request, answered by the broker."""
    image = region.tensor(np.float32, IMAGE)
    image.array[:] = 1.0
    endpoint = json.loads(daemon.config_path.read_text())["tcp_endpoint"]
    with Client(endpoint) as client:
        with pytest.raises(InferenceError, match="ipc endpoint only") as caught:
            client.infer("resnet18", {"image": image}, timeout=10)
        assert caught.value.code == ErrorCode.BAD_REQUEST
        assert client.infer("resnet18", {"image": image.array}, timeout=10)["logits"].shape == (1, 1000)


def _wchan(pid: int) -> str:
    """The kernel function a process sleeps in ("wait_for_partner": blocked opening a FIFO)."""
    return Path(f"/proc/{pid}/wchan").read_text()


def test_a_fifo_is_refused_without_releasing_the_writer_blocked_on_it(daemon: Daemon) -> None:
    """Naming a FIFO is INVALID_INPUT, and a writer waiting in open() for a reader is still waiting afterwards."""
    fifo = Path(SHM_DIR) / f"infervisor-test-{os.getpid()}-fifo"
    os.mkfifo(fifo, 0o600)
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fifo)!r}, 'wb')"])
    try:
        wait_for(lambda: _wchan(writer.pid) == "wait_for_partner", 30, "the writer blocked opening the FIFO")
        with Client(daemon.endpoint) as client:
            with pytest.raises(InferenceError, match="is not a regular file") as caught:
                client.infer("resnet18", {"image": SharedTensor(fifo.name, 0, np.zeros(IMAGE, np.float32))}, timeout=10)
        assert caught.value.code == ErrorCode.INVALID_INPUT
        # Opening the FIFO even for an instant (O_NONBLOCK included) would have woken the writer.
        assert writer.poll() is None and _wchan(writer.pid) == "wait_for_partner"
    finally:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
        writer.wait(30)
        fifo.unlink()


def _give_away(path: Path, mode: int) -> None:
    os.chown(path, OTHER_ID, OTHER_ID)
    os.chmod(path, mode)


@pytest.mark.parametrize(
    ("prepare", "needle"),
    [
        pytest.param(
            lambda path: _give_away(path, 0o600),
            f"belongs to uid {OTHER_ID}, not to the daemon's user (uid {os.geteuid()})",
            marks=needs_root,
            id="0600-of-another-uid",
        ),
        pytest.param(
            lambda path: _give_away(path, 0o644),
            f"belongs to uid {OTHER_ID}, not to the daemon's user (uid {os.geteuid()})",
            marks=needs_root,
            id="0644-of-another-uid",
        ),
        pytest.param(
            lambda path: os.chmod(path, 0),
            f"is not readable by the daemon's user (uid {os.geteuid()}): mode 0000",
            id="0000-of-ours",
        ),
    ],
)
def test_the_worker_refuses_an_object_the_daemon_does_not_own_or_may_not_read(
    daemon: Daemon, prepare: Any, needle: str
) -> None:
    """Objects of another uid, and ours without read permission, are INVALID_INPUT even to a root daemon."""
    before = _worker_pids(daemon)
    with SharedRegion(4 * 2**20) as bad, SharedRegion(4 * 2**20) as good, Client(daemon.endpoint) as client:
        bad.tensor(np.float32, IMAGE).array[:] = 1.0
        image = good.tensor(np.float32, IMAGE)
        image.array[:] = 1.0
        prepare(Path(SHM_DIR) / bad.name)
        with pytest.raises(InferenceError) as caught:
            client.infer("resnet18", {"image": SharedTensor(bad.name, 0, image.array)}, timeout=10)
        assert caught.value.code == ErrorCode.INVALID_INPUT
        assert needle in caught.value.message
        assert client.infer("resnet18", {"image": image}, timeout=10)["logits"].shape == (1, 1000)
    assert _worker_pids(daemon) == before


def test_the_worker_refuses_a_symbolic_link_to_a_readable_object(daemon: Daemon, region: SharedRegion) -> None:
    """A link in /dev/shm to a region the daemon could read is still INVALID_INPUT: links are never followed."""
    image = region.tensor(np.float32, IMAGE)
    image.array[:] = 1.0
    link = Path(SHM_DIR) / f"infervisor-test-{os.getpid()}-link"
    link.symlink_to(Path(SHM_DIR) / region.name)
    try:
        with Client(daemon.endpoint) as client:
            with pytest.raises(InferenceError, match="is a symbolic link") as caught:
                client.infer("resnet18", {"image": SharedTensor(link.name, 0, image.array)}, timeout=10)
            assert caught.value.code == ErrorCode.INVALID_INPUT
    finally:
        link.unlink()


@needs_root
def test_an_object_of_another_uid_is_read_only_through_the_client_group(region: SharedRegion) -> None:
    """Group-owned by the configured client group and group-readable: read; otherwise refused, saying why."""
    path = Path(SHM_DIR) / region.name
    region.tensor(np.float32, (4,), offset=0).array[:] = np.arange(4)
    desc = TensorDesc("x", "float32", (4,), ShmRef(region.name, 0))
    _give_away(path, 0o640)
    assert np.array_equal(SharedInputs(client_group=OTHER_ID).read(desc, OTHER).view(np.float32), np.arange(4))
    with pytest.raises(ProtocolError, match=f"belongs to uid {OTHER_ID}, not to the daemon's user"):
        SharedInputs().read(desc, ME)
    with pytest.raises(ProtocolError, match=f"belongs to uid {OTHER_ID}, not to the daemon's user"):
        SharedInputs(client_group=OTHER_ID + 1).read(desc, OTHER)
    os.chmod(path, 0o600)
    with pytest.raises(ProtocolError, match=f"is not readable by the client group \\(gid {OTHER_ID}\\): mode 0600"):
        SharedInputs(client_group=OTHER_ID).read(desc, OTHER)
    # The daemon's own object is judged by its owner bits alone (section 5.1): 0040 in the client group is refused.
    os.chown(path, os.geteuid(), OTHER_ID)
    os.chmod(path, 0o040)
    with pytest.raises(
        ProtocolError, match=f"is not readable by the daemon's user \\(uid {os.geteuid()}\\): mode 0040"
    ):
        SharedInputs(client_group=OTHER_ID).read(desc, OTHER)
    assert "`0040` in the client group is refused" in " ".join((ROOT / "docs" / "protocol.md").read_text().split())


def test_the_reader_reads_only_what_the_requesting_client_could_read_itself(region: SharedRegion) -> None:
    """The daemon's own 0600 object is refused for another uid, read for its owner, and never without credentials."""
    region.tensor(np.float32, (4,), offset=0).array[:] = np.arange(4)
    desc = TensorDesc("x", "float32", (4,), ShmRef(region.name, 0))
    assert np.array_equal(SharedInputs().read(desc, ME).view(np.float32), np.arange(4))
    for reader, needle in [
        (OTHER, f"is not readable by the client that named it (uid {OTHER_ID}, groups [{OTHER_ID}])"),
        (None, "cannot be read for a client whose credentials are unknown"),
    ]:
        with pytest.raises(ProtocolError) as caught:
            SharedInputs().read(desc, reader)
        assert caught.value.code == ErrorCode.INVALID_INPUT
        assert needle in caught.value.message, caught.value.message
    # In the object's group with the group's read bit: the other uid could read it, so it is read for it.
    os.chmod(Path(SHM_DIR) / region.name, 0o640)
    in_group = [OTHER_ID, OTHER_ID, os.stat(Path(SHM_DIR) / region.name).st_gid]
    assert np.array_equal(SharedInputs().read(desc, in_group).view(np.float32), np.arange(4))


def test_a_region_never_closed_is_unlinked_at_a_normal_exit(tmp_path: Path) -> None:
    """A process that makes a region (and a tensor in it) and exits without close() leaves nothing in /dev/shm."""
    script = (
        "import numpy as np\n"
        "from infervisor.protocol.shared_memory import SharedRegion\n"
        "region = SharedRegion(4096)\n"
        "region.tensor(np.float32, (4,)).array[:] = 1\n"
        "print(region.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    name = done.stdout.strip()
    assert name.startswith("infervisor-")
    assert not (Path(SHM_DIR) / name).exists(), f"{name} left in {SHM_DIR}"
