"""The supervisor-worker link: multipart messages over one Unix stream socket per worker process.

The supervisor makes a socketpair for each worker it spawns and the worker inherits one end, so
there is no listening socket to find or spoof and a worker's death reads as an EOF at once. A
message crosses with one wake-up, the reader's; over a ZeroMQ ipc socket it takes three (sender's
I/O thread, receiver's I/O thread, reader). `python bench/link.py` on the 2-vCPU VM: a round trip
between two processes took 58 us over a link against 86 us over DEALER/ROUTER back to back, and
25 us against 92 us with 300 us of idle between round trips (docs/protocol.md, appendix A).

Wire: u32 frame count, one u64 length per frame (little-endian), then the frames, each followed by
zero bytes up to a multiple of 16, so that every frame of a received message starts 16-byte aligned
(as a malloc'd ZeroMQ frame did): tensors are viewed in place, and kernels may assume alignment.
Both ends use the socket non-blocking; what the kernel does not take at once waits in an outbox.
"""

from __future__ import annotations

import collections
import itertools
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from infervisor.protocol.constants import MAX_BATCH_REQUESTS, MAX_TENSORS, ErrorCode
from infervisor.protocol.errors import ProtocolError

#: Frames in one link message at most: a batch of MAX_BATCH_REQUESTS requests (its header, then per member a
#: REQUEST header, the client's header and its tensors).
WORKER_LINK_FRAMES = 1 + MAX_BATCH_REQUESTS * (2 + MAX_TENSORS)

_COUNT = struct.Struct("<I")
#: A message's length prefix by frame count: the count, then each frame's length (made ahead for one request's).
_PREFIXES = [struct.Struct(f"<I{count}Q") for count in range(2 + MAX_TENSORS + 1)]
#: Frames start at multiples of this within a message's payload (and payload buffers are malloc-aligned).
_ALIGN = 16
_PADDING = memoryview(bytes(_ALIGN))
#: Receive buffer for small messages; a message longer than half of it is read into its own buffer.
_CHUNK = 256 * 1024
#: Buffers handed to one sendmsg (Linux IOV_MAX is 1024).
_IOV_MAX = 1024


class LinkClosed(Exception):
    """The other end closed the link (its process exited) or stopped reading for too long."""


def _padded(length: int) -> int:
    """`length` rounded up to the frame alignment."""
    return (length + _ALIGN - 1) & -_ALIGN


def _view(frame: Any) -> memoryview:
    """A flat byte view of a frame: bytes, a received buffer, a zmq.Frame or a C-contiguous array."""
    view = memoryview(frame)
    if view.nbytes == 0:
        return memoryview(b"")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Link:
    """One end of a worker link: send and receive whole multipart messages without blocking."""

    def __init__(self, sock: socket.socket, max_frames: int, max_frame_bytes: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.max_frames = max_frames
        self.max_frame_bytes = max_frame_bytes
        self._outbox: collections.deque[memoryview] = collections.deque()
        self._buffer = bytearray(_CHUNK)
        #: A view kept for slicing: making one per receive costs a call on a path that runs cold.
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        #: A message too large for the receive buffer is filled in place here.
        self._large: bytearray | None = None
        self._large_filled = 0
        self._large_lengths: tuple[int, ...] = ()
        self._eof = False
        #: A broken frame layout found after whole messages: raised by the next receive, once those are handed over.
        self._broken: ProtocolError | None = None
        #: False once a write failed or EOF was read: nothing sent now could be read by anyone.
        self.sendable = True
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)

    def fileno(self) -> int:
        """The socket's descriptor, for a poller."""
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        """Bytes wait in the outbox for the socket to take them."""
        return bool(self._outbox)

    def close(self) -> None:
        """Close this end; the other end reads EOF."""
        self._outbox.clear()
        self.sock.close()

    # ---- sending ----------------------------------------------------------------------------

    def send(self, frames: Sequence[Any]) -> None:
        """Write one message now if the socket takes it, else queue what it did not take (frames are not copied).

        One sendmsg straight from the frames: this runs right after a forward pass, when every line of
        code it touches is cold and costs about ten times its warm price (`python bench/cold_path.py`).
        """
        if not self.sendable:
            raise LinkClosed("the link is closed for sending")
        views = [_view(f) for f in frames]
        count = len(views)
        prefix = _PREFIXES[count] if count < len(_PREFIXES) else struct.Struct(f"<I{count}Q")
        buffers: list[memoryview | bytes] = [prefix.pack(count, *[v.nbytes for v in views])]
        total = len(buffers[0])
        for view in views:
            length = view.nbytes
            if length:
                buffers.append(view)
            if length % _ALIGN:
                buffers.append(_PADDING[: _padded(length) - length])
            total += _padded(length)
        if self._outbox:  # behind earlier bytes it must wait for them anyway (the poller says when)
            self._outbox.extend(memoryview(b) for b in buffers)
            return
        if len(buffers) > _IOV_MAX:
            self._outbox.extend(memoryview(b) for b in buffers)
            self.flush()
            return
        sent = self._sendmsg(buffers)
        if sent < total:
            self._outbox.extend(memoryview(b) for b in buffers)
            self._drop_sent(sent)

    def _sendmsg(self, buffers: list[Any]) -> int:
        """Bytes the socket took now (0 if it would block); raises LinkClosed if the other end is gone."""
        try:
            return self.sock.sendmsg(buffers)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.sendable = False
            self._outbox.clear()
            raise LinkClosed(f"the other end is gone: {exc}") from exc

    def _drop_sent(self, sent: int) -> None:
        """Take the `sent` bytes the socket took off the front of the outbox."""
        outbox = self._outbox
        while sent:
            head = outbox[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                outbox.popleft()
            else:
                outbox[0] = head[sent:]
                sent = 0

    def flush(self) -> None:
        """Write queued bytes until the socket would block; raises LinkClosed if the other end is gone."""
        outbox = self._outbox
        while outbox:
            sent = self._sendmsg(list(itertools.islice(outbox, _IOV_MAX)))
            if not sent:
                return
            self._drop_sent(sent)

    def flush_blocking(self, timeout: float) -> None:
        """Write the whole outbox, waiting for the other end to read; LinkClosed after `timeout` s without progress."""
        writable = select.poll()  # poll, not select: the descriptor may be above select's 1024
        writable.register(self.sock.fileno(), select.POLLOUT)
        give_up = time.monotonic() + timeout
        while True:
            left = sum(v.nbytes for v in self._outbox)
            self.flush()
            if not self._outbox:
                return
            now = time.monotonic()
            if sum(v.nbytes for v in self._outbox) < left:
                give_up = now + timeout  # a slow reader that reads is not a lost one
            if now >= give_up:
                raise LinkClosed(f"the other end read nothing for {timeout:.1f} s")
            writable.poll(max(1, int((give_up - now) * 1000)))

    # ---- receiving --------------------------------------------------------------------------

    def wait_readable(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for something to read (or EOF)."""
        return bool(self._poller.poll(max(0, int(timeout * 1000))))

    def receive(self) -> list[list[memoryview]]:
        """Every whole message readable now, each a list of frames; LinkClosed at EOF.

        A broken frame layout raises ProtocolError: a byte stream cannot be resynchronised, so the
        caller must drop the link.
        """
        if self._broken is not None:
            broken, self._broken = self._broken, None
            raise broken
        if self._eof:
            raise LinkClosed("the other end closed the link")
        messages: list[list[memoryview]] = []
        while True:
            if self._large is not None:
                got = self._recv_into(memoryview(self._large)[self._large_filled :])
                if got is None:
                    break
                self._large_filled += got
                if self._large_filled == len(self._large):
                    messages.append(_split(self._large, self._large_lengths))
                    self._large = None
                continue
            if self._start:
                self._compact()
            space = _CHUNK - self._end
            got = self._recv_into(self._view[self._end :])
            if got is None:
                break
            self._end += got
            try:
                self._parse(messages)
            except ProtocolError as exc:
                # Nothing after broken framing can be read: the link is over, reported once.
                self._eof, self.sendable = True, False
                if not messages:
                    raise
                self._broken = exc  # hand over the whole messages before it; the next receive raises
                return messages
            if got < space:  # drained for now; the poller says when more comes
                break
        if self._eof and not messages:
            raise LinkClosed("the other end closed the link")
        return messages

    def _recv_into(self, view: memoryview) -> int | None:
        """Bytes read into `view`, None if nothing is there yet; at EOF marks the link and returns None."""
        try:
            got = self.sock.recv_into(view)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            got = 0
        if got == 0:
            self._eof = True
            self.sendable = False
            return None
        return got

    def _compact(self) -> None:
        """Move the unparsed tail to the front of the receive buffer."""
        pending = self._end - self._start
        if pending:
            self._buffer[:pending] = self._view[self._start : self._end]
        self._start, self._end = 0, pending

    def _parse(self, messages: list[list[memoryview]]) -> None:
        """Cut every whole message out of the receive buffer; start a large one's own buffer."""
        buffer, start, end = self._buffer, self._start, self._end
        while end - start >= _COUNT.size:
            (count,) = _COUNT.unpack_from(buffer, start)
            if not 0 < count <= self.max_frames:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"link message of {count} frames (1..{self.max_frames})")
            prefix = _PREFIXES[count] if count < len(_PREFIXES) else struct.Struct(f"<I{count}Q")
            if end - start < prefix.size:
                break
            lengths = prefix.unpack_from(buffer, start)[1:]
            if max(lengths) > self.max_frame_bytes:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"link frame of {max(lengths)} bytes, limit {self.max_frame_bytes}"
                )
            body = start + prefix.size
            total = sum(_padded(length) for length in lengths)
            if end - body >= total:
                # A fresh bytes object per message: its data is 16-byte aligned, and no later
                # receive can overwrite frames the caller still holds.
                messages.append(_split(self._view[body : body + total].tobytes(), lengths))
                start = body + total
                continue
            if prefix.size + total > _CHUNK // 2:
                received = end - body
                try:
                    self._large = bytearray(total)
                except MemoryError:
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST, f"link message of {total} bytes is beyond memory"
                    ) from None
                self._large[:received] = self._view[body:end]
                self._large_filled, self._large_lengths = received, lengths
                start = end = 0
            break
        self._start, self._end = start, end


def _split(payload: bytes | bytearray, lengths: Sequence[int]) -> list[memoryview]:
    """The frames of one message as views of its payload."""
    view = memoryview(payload)
    frames: list[memoryview] = []
    offset = 0
    for length in lengths:
        frames.append(view[offset : offset + length])
        offset += _padded(length)
    return frames
