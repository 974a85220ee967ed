"""The opt-in HTTP endpoint serving /metrics from a thread of its own, every connection at once.

Any local user can open TCP connections to the port and send nothing. One selector loop holds
every connection without blocking on any: a connection gets HEADER_TIMEOUT_S to send its request
line and headers, each peer address keeps at most PER_PEER_PENDING of them waiting, all peers
together MAX_PENDING; past a cap the oldest waiting one is closed, so a new connection (a scrape
sends its request at once) is always read. Answers are written without blocking too, each within
WRITE_TIMEOUT_S, so a client that stops reading holds nothing but its own connection.
"""

from __future__ import annotations

import collections
import io
import selectors
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.types import WSGIApplication

import structlog

log = structlog.get_logger("supervisor")

#: A connection must have sent its whole request head this soon after it was accepted, or is closed.
HEADER_TIMEOUT_S = 2.0
#: An answer must have been taken by the client this soon after it was ready, or the connection is closed.
WRITE_TIMEOUT_S = 10.0
#: Connections of one peer address still sending their request head; a newer one closes the oldest.
PER_PEER_PENDING = 8
#: Connections of all peers still sending their request head.
MAX_PENDING = 128
#: A request head longer than this is answered 431 (a scrape's is a few hundred bytes).
MAX_HEAD_BYTES = 8192
#: How often the loop wakes to close connections past their deadline and to notice close().
_TICK_S = 0.1


def parse_listen(address: str) -> tuple[str, int, socket.AddressFamily]:
    """HOST:PORT (as config validation accepts it) as bind arguments: `[::1]:9464` is IPv6, `localhost` 127.0.0.1."""
    host, _, port = address.rpartition(":")
    if host.startswith("["):
        return host[1:-1], int(port), socket.AF_INET6
    return ("127.0.0.1" if host == "localhost" else host), int(port), socket.AF_INET


@dataclass(eq=False)
class _Connection:
    """One accepted connection: what it sent so far, or the answer still to write, and until when."""

    sock: socket.socket
    peer: str
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    outgoing: memoryview | None = None


def _status_line(status: str) -> bytes:
    return f"HTTP/1.1 {status}\r\n".encode("latin-1")


def _plain(status: str, text: str) -> bytes:
    body = text.encode()
    head = f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return _status_line(status) + head.encode("latin-1") + body


def _environ(head: bytes, server: tuple[str, int]) -> dict[str, Any] | None:
    """The WSGI environ of a request head, or None when it is not an HTTP/1.x request line with headers."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    method, target, protocol = parts
    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SERVER_NAME": server[0],
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": protocol,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            continue
        key = name.strip().upper().replace("-", "_")
        if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            environ[key] = value.strip()
        else:
            environ[f"HTTP_{key}"] = value.strip()
    return environ


def _answer(app: WSGIApplication, environ: dict[str, Any]) -> bytes:
    """The whole HTTP answer of the WSGI app to one request, closing the connection after it."""
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started[:] = [status, headers]
        return lambda data: None  # the write() callable: prometheus_client's app does not use it

    chunks: Iterable[bytes] = app(environ, start_response)
    try:
        body = b"".join(chunks)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    status, headers = started
    head = [f"{name}: {value}" for name, value in headers if name.lower() not in ("connection", "content-length")]
    head += [f"Content-Length: {len(body)}", "Connection: close"]
    if environ["REQUEST_METHOD"] == "HEAD":
        body = b""
    return _status_line(status) + ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _Loop:
    """The selector loop of one listening socket: accepts, reads heads, answers, closes."""

    def __init__(self, listener: socket.socket, app: WSGIApplication) -> None:
        self.listener = listener
        self.app = app
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        #: Connections still sending their request head, oldest first (the cap closes from the front).
        self.pending: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self.writing: set[_Connection] = set()
        self.stopping = threading.Event()

    def run(self) -> None:
        """Serve until close(); nothing a client does ends the loop."""
        while not self.stopping.is_set():
            for key, events in self.selector.select(_TICK_S):
                try:
                    self._ready(key.data, events)
                except Exception:  # a bug on one connection must cost that connection only
                    log.warning("metrics_request_failed", exc_info=True)
                    if key.data is not None:
                        self._close(key.data)
            self._expire(time.monotonic())
        for connection in [*self.pending, *self.writing]:
            self._close(connection)
        self.selector.close()

    def _ready(self, connection: _Connection | None, events: int) -> None:
        if connection is None:
            self._accept()
        elif events & selectors.EVENT_READ and connection in self.pending:
            self._read(connection)
        elif events & selectors.EVENT_WRITE and connection in self.writing:
            self._write(connection)

    def _accept(self) -> None:
        try:
            sock, address = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and the like: the connection stays in the backlog, the loop goes on
            log.warning("metrics_accept_failed", error=str(exc))
            return
        sock.setblocking(False)
        peer = str(address[0])
        of_peer = [c for c in self.pending if c.peer == peer]
        if len(of_peer) >= PER_PEER_PENDING:
            self._close(of_peer[0])
        if len(self.pending) >= MAX_PENDING:
            self._close(next(iter(self.pending)))
        connection = _Connection(sock, peer, time.monotonic() + HEADER_TIMEOUT_S)
        self.pending[connection] = None
        self.selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(MAX_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(connection)
            return
        connection.received += data
        end = connection.received.find(b"\r\n\r\n")
        if end < 0:
            if len(connection.received) > MAX_HEAD_BYTES:
                self._respond(connection, _plain("431 Request Header Fields Too Large", "request head too large\n"))
            return
        environ = _environ(bytes(connection.received[:end]), self.listener.getsockname()[:2])
        if environ is None:
            self._respond(connection, _plain("400 Bad Request", "not an HTTP/1.x request\n"))
        else:
            self._respond(connection, _answer(self.app, environ))

    def _respond(self, connection: _Connection, answer: bytes) -> None:
        del self.pending[connection]
        connection.outgoing = memoryview(answer)
        connection.deadline = time.monotonic() + WRITE_TIMEOUT_S
        self.writing.add(connection)
        self.selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
        self._write(connection)  # most answers fit the socket buffer at once

    def _write(self, connection: _Connection) -> None:
        outgoing = connection.outgoing
        if outgoing is None:
            return
        try:
            sent = connection.sock.send(outgoing)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(connection)
            return
        connection.outgoing = outgoing[sent:]
        if not connection.outgoing:
            self._close(connection)

    def _expire(self, now: float) -> None:
        for connection in [c for c in [*self.pending, *self.writing] if c.deadline <= now]:
            self._close(connection)

    def _close(self, connection: _Connection) -> None:
        self.pending.pop(connection, None)
        self.writing.discard(connection)
        try:
            self.selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()


class HttpEndpoint:
    """One WSGI app served on HOST:PORT from a daemon thread; a bind failure is kept as `error`, not raised."""

    def __init__(self) -> None:
        self.loop: _Loop | None = None
        self.thread: threading.Thread | None = None
        #: Where scrapes go once listening, and why not when binding failed.
        self.url: str | None = None
        self.error: str | None = None

    def listen(self, address: str, app: WSGIApplication) -> None:
        """Serve `app` at /metrics on HOST:PORT; a failure is logged and shown, serving goes on."""
        host, port, family = parse_listen(address)
        try:
            listener = socket.create_server((host, port), family=family, backlog=256)
        except OSError as exc:
            self.error = f"cannot listen on {address}: {exc.strerror or exc}"
            log.error("metrics_listen_failed", listen=address, error=self.error)
            return
        listener.setblocking(False)
        self.loop = _Loop(listener, app)
        self.thread = threading.Thread(target=self.loop.run, name="metrics-http", daemon=True)
        self.thread.start()
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = f"http://{shown}:{port}/metrics"
        log.info("metrics_listening", url=self.url)

    def close(self) -> None:
        """Stop serving and close the socket."""
        if self.loop is not None:
            self.loop.stopping.set()
            if self.thread is not None:
                self.thread.join(timeout=5.0)
            self.loop.listener.close()
            self.loop = None
