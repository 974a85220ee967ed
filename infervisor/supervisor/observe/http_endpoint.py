"""The opt-in HTTP endpoint serving /metrics from a thread of its own (wsgiref, one request at a time).

A slow or hostile scraper holds only this thread: each connection has a read timeout.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import WSGIApplication

import structlog

log = structlog.get_logger("supervisor")

#: The HTTP endpoint drops a connection that sends nothing for this long (a stuck scraper holds one thread).
READ_TIMEOUT_S = 5.0


def parse_listen(address: str) -> tuple[str, int, socket.AddressFamily]:
    """HOST:PORT (as config validation accepts it) as bind arguments: `[::1]:9464` is IPv6, `localhost` 127.0.0.1."""
    host, _, port = address.rpartition(":")
    if host.startswith("["):
        return host[1:-1], int(port), socket.AF_INET6
    return ("127.0.0.1" if host == "localhost" else host), int(port), socket.AF_INET


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (stdout and stderr are the JSON log); a read timeout per connection."""

    timeout = READ_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's parameter name
        """Scrapes are not logged."""


class _Server(WSGIServer):
    """wsgiref's server, one request at a time on its one thread, without a reverse DNS lookup at bind."""

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks getfqdn(host), which can stall start-up on a box without DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("metrics_request_failed", client=str(client_address), exc_info=True)


class _Server6(_Server):
    """The same on IPv6."""

    address_family = socket.AF_INET6


class HttpEndpoint:
    """One WSGI app served on HOST:PORT from a daemon thread; a bind failure is kept as `error`, not raised."""

    def __init__(self) -> None:
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None
        #: Where scrapes go once listening, and why not when binding failed.
        self.url: str | None = None
        self.error: str | None = None

    def listen(self, address: str, app: WSGIApplication) -> None:
        """Serve `app` at /metrics on HOST:PORT; a failure is logged and shown, serving goes on."""
        host, port, family = parse_listen(address)
        server_class = _Server6 if family == socket.AF_INET6 else _Server
        try:
            server = make_server(host, port, app, server_class, _QuietHandler)
        except OSError as exc:
            self.error = f"cannot listen on {address}: {exc.strerror or exc}"
            log.error("metrics_listen_failed", listen=address, error=self.error)
            return
        self.server = server
        # poll_interval bounds how long close() waits for the thread to notice.
        self.thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )
        self.thread.start()
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = f"http://{shown}:{port}/metrics"
        log.info("metrics_listening", url=self.url)

    def close(self) -> None:
        """Stop serving and close the socket."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
