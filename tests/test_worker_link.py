"""The supervisor-worker link: framing, partial writes, large messages, EOF and garbage, on real socketpairs."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link, LinkClosed


@pytest.fixture
def pair() -> Iterator[tuple[Link, Link]]:
    """Two linked ends, as the supervisor and one worker hold them."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = Link(ours, WORKER_LINK_FRAMES, 2**30), Link(theirs, WORKER_LINK_FRAMES, 2**30)
    yield a, b
    a.close()
    b.close()


def _receive(link: Link, count: int, timeout: float = 10.0) -> list[list[bytes]]:
    """Exactly `count` messages, waiting for them with a deadline."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"got {len(got)} of {count} messages")
        if link.wait_readable(0.05):
            got.extend([bytes(f) for f in message] for message in link.receive())
    return got


def _pump(sender: Link, receiver: Link, count: int) -> list[list[bytes]]:
    """Receive `count` messages while flushing what the sender could not write at once."""
    got: list[list[bytes]] = []
    deadline = time.monotonic() + 20
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"got {len(got)} of {count} messages")
        sender.flush()
        if receiver.wait_readable(0.01):
            got.extend([bytes(f) for f in message] for message in receiver.receive())
    return got


def test_messages_arrive_whole_and_in_order(pair: tuple[Link, Link]) -> None:
    """Several multipart messages, empty frames included, come out as they went in."""
    a, b = pair
    sent = [[b"head", b"", b"x" * 100], [b"one"], [b"", b""], [bytes(range(256)) * 3, b"tail"]]
    for message in sent:
        a.send(message)
    assert _receive(b, len(sent)) == sent


def test_arrays_and_memoryviews_are_sent_as_their_bytes(pair: tuple[Link, Link]) -> None:
    """A C-contiguous array (any rank, empty or 0-d) and a memoryview travel as their raw bytes."""
    a, b = pair
    image = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    empty = np.zeros((0, 3), dtype=np.int64)
    scalar = np.array(7.5, dtype=np.float64)
    a.send([b"h", image, empty, scalar, memoryview(b"view")])
    ((head, got_image, got_empty, got_scalar, view),) = _receive(b, 1)
    assert head == b"h" and got_empty == b"" and view == b"view"
    assert np.array_equal(np.frombuffer(got_image, dtype=np.float32).reshape(2, 3, 4), image)
    assert np.frombuffer(got_scalar, dtype=np.float64)[0] == 7.5


def test_a_message_larger_than_the_socket_buffer_waits_in_the_outbox(pair: tuple[Link, Link]) -> None:
    """A 20 MB message is not taken at once: the sender keeps the rest, and it arrives whole after flushes."""
    a, b = pair
    payload = np.random.default_rng(0).integers(0, 255, 20 * 2**20, dtype=np.uint8)
    a.send([b"big", payload])
    assert a.wants_write, "a socketpair buffer cannot hold 20 MB; the remainder must be queued"
    a.send([b"after"])  # queued behind the big one, never interleaved with it
    (big, after) = _pump(a, b, 2)
    assert big[0] == b"big" and big[1] == payload.tobytes()
    assert after == [b"after"]
    assert not a.wants_write


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=300_000), min_size=1, max_size=5), min_size=1, max_size=6))
def test_any_sequence_of_messages_round_trips(messages: list[list[bytes]]) -> None:
    """Whatever the sizes (small, large, empty), messages come out whole and in order."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = Link(ours, WORKER_LINK_FRAMES, 2**30), Link(theirs, WORKER_LINK_FRAMES, 2**30)
    try:
        for message in messages:
            a.send(message)
        assert _pump(a, b, len(messages)) == messages
    finally:
        a.close()
        b.close()


def test_bytes_arriving_one_at_a_time_still_make_whole_messages(pair: tuple[Link, Link]) -> None:
    """A message dribbled in byte by byte is assembled, and nothing is returned before it is complete."""
    a, b = pair
    wire = struct.pack("<I2Q", 2, 3, 5) + b"abc" + bytes(13) + b"defgh" + bytes(11)  # frames padded to 16
    raw = a.sock
    for byte in wire[:-1]:
        raw.send(bytes([byte]))
        if b.wait_readable(1.0):
            assert b.receive() == []
    raw.send(wire[-1:])
    assert _receive(b, 1) == [[b"abc", b"defgh"]]


@pytest.mark.parametrize("payload_bytes", [100, 600_000])  # the receive buffer, and a message's own buffer
def test_a_message_partly_read_is_held_until_it_is_whole(pair: tuple[Link, Link], payload_bytes: int) -> None:
    """Receives that got only part of a message return nothing (the socket may be empty); the rest completes it."""
    a, b = pair
    wire = struct.pack("<I1Q", 1, payload_bytes) + bytes(payload_bytes) + bytes(-payload_bytes % 16)
    head, sent = memoryview(wire)[:-7], 0
    deadline = time.monotonic() + 10
    while sent < len(head) or b.wait_readable(0):  # write all but the last 7 bytes, reading as they arrive
        assert time.monotonic() < deadline, "the first part never arrived"
        try:
            sent += a.sock.send(head[sent:])
        except BlockingIOError:
            pass  # the socket is full until the reader takes some
        assert b.receive() == []
    a.sock.sendall(wire[-7:])
    assert _receive(b, 1) == [[bytes(payload_bytes)]]


def test_closing_one_end_reads_as_link_closed_after_what_was_sent(pair: tuple[Link, Link]) -> None:
    """A worker's last message before it exits is delivered; the next receive reports the closed link."""
    a, b = pair
    a.send([b"last words"])
    a.close()
    assert _receive(b, 1) == [[b"last words"]]
    assert b.wait_readable(1.0)
    with pytest.raises(LinkClosed):
        b.receive()


def test_sending_to_a_closed_link_raises_link_closed(pair: tuple[Link, Link]) -> None:
    """A send after the other process is gone fails with LinkClosed, not a broken-pipe crash."""
    a, b = pair
    b.close()
    with pytest.raises(LinkClosed):
        for _ in range(3):  # the first write may land in the buffer before the close is noticed
            a.send([b"x" * 1024])


def test_flush_blocking_gives_up_when_the_other_end_stops_reading(pair: tuple[Link, Link]) -> None:
    """A peer that never reads (a stopped supervisor) makes a blocking flush fail after its timeout."""
    a, _ = pair
    a.send([np.zeros(8 * 2**20, dtype=np.uint8)])
    started = time.monotonic()
    with pytest.raises(LinkClosed, match="read nothing"):
        a.flush_blocking(0.3)
    assert 0.25 <= time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (struct.pack("<I", 0), "0 frames"),
        (struct.pack("<I", WORKER_LINK_FRAMES + 1), "frames"),
        (struct.pack("<IQ", 1, 2**31), "limit"),
    ],
    ids=["no-frames", "too-many-frames", "frame-too-large"],
)
def test_a_broken_frame_layout_is_a_protocol_error(pair: tuple[Link, Link], wire: bytes, match: str) -> None:
    """Garbage in the length prefix raises ProtocolError (the caller drops the link), never a huge allocation."""
    a, b = pair
    small = Link(b.sock, WORKER_LINK_FRAMES, 2**30 - 1)
    a.sock.send(wire)
    assert small.wait_readable(1.0)
    with pytest.raises(ProtocolError, match=match):
        small.receive()


def _address(frame: memoryview) -> int:
    """Where a received frame's bytes start in memory."""
    return int(np.frombuffer(frame, dtype=np.uint8).ctypes.data)


@pytest.mark.parametrize("tensor_bytes", [64, 600_000], ids=["small-message", "large-message"])
def test_every_received_frame_starts_16_byte_aligned(pair: tuple[Link, Link], tensor_bytes: int) -> None:
    """Frames after odd-length headers still start on 16 bytes, as malloc'd ZeroMQ frames did, in both read paths."""
    a, b = pair
    a.send([b"h" * 5, b"\x01" * 3, np.ones(tensor_bytes // 4, dtype=np.float32), b"z"])
    (message,) = _pump(a, b, 1)
    a.send([b"h" * 5, b"\x01" * 3, np.ones(tensor_bytes // 4, dtype=np.float32), b"z"])
    deadline = time.monotonic() + 10
    frames: list[memoryview] = []
    while not frames and time.monotonic() < deadline:
        a.flush()
        if b.wait_readable(0.01):
            frames = next(iter(b.receive()), [])
    assert [bytes(f) for f in frames] == message
    assert all(_address(f) % 16 == 0 for f in frames if f.nbytes)


def test_whole_messages_before_a_broken_prefix_are_handed_over_first(pair: tuple[Link, Link]) -> None:
    """Replies a worker sent before garbling its stream are delivered; the error comes with the next receive."""
    a, b = pair
    a.send([b"first"])
    a.send([b"second"])
    a.sock.send(struct.pack("<I", 0))  # with the two messages already in the socket, one receive sees all
    assert b.wait_readable(1.0)
    assert [[bytes(f) for f in m] for m in b.receive()] == [[b"first"], [b"second"]]
    with pytest.raises(ProtocolError, match="0 frames"):
        b.receive()
    with pytest.raises(LinkClosed):  # reported once; after it the link is simply over
        b.receive()
    assert not b.sendable


def test_a_reader_that_keeps_reading_never_times_out_a_blocking_flush(pair: tuple[Link, Link]) -> None:
    """The timeout counts time without progress: 8 MB read slowly in small bites for longer than it still arrives."""
    a, b = pair
    payload = np.arange(2 * 2**20, dtype=np.float32)  # 8 MB, far over the socket buffer
    a.send([payload])
    received = bytearray()
    stop = threading.Event()

    def slow_reader() -> None:
        while not stop.is_set():
            try:
                chunk = b.sock.recv(256 * 1024)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            if not chunk:
                return
            received.extend(chunk)
            time.sleep(0.02)  # the slowness under test: one 256 KB bite every 20 ms

    reader = threading.Thread(target=slow_reader)
    reader.start()
    started = time.monotonic()
    try:
        a.flush_blocking(0.3)  # the whole transfer takes well over 0.3 s; no single wait does
    finally:
        stop.set()
        reader.join(10)
    assert time.monotonic() - started > 0.3
    assert not a.wants_write


def test_a_link_at_eof_refuses_to_send(pair: tuple[Link, Link]) -> None:
    """Once EOF was read, the link is no longer sendable and a send fails at once (the broker skips that worker)."""
    a, b = pair
    b.close()
    assert a.wait_readable(1.0)
    with pytest.raises(LinkClosed):
        a.receive()
    assert not a.sendable
    with pytest.raises(LinkClosed, match="closed for sending"):
        a.send([b"x"])


def test_a_message_too_large_to_allocate_is_a_protocol_error(pair: tuple[Link, Link]) -> None:
    """Lengths that add up beyond memory are refused as garbage, not raised as MemoryError into the broker."""
    a, b = pair
    huge = Link(b.sock, WORKER_LINK_FRAMES, 2**44)
    a.sock.send(struct.pack("<I4Q", 4, 2**44, 2**44, 2**44, 2**44))
    assert huge.wait_readable(1.0)
    with pytest.raises(ProtocolError, match="beyond memory"):
        huge.receive()
