"""CURVE for the tcp endpoint: the server's key pair from a zmq certificate, clients allowed by their public keys."""

from __future__ import annotations

from typing import Any

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from infervisor.supervisor.settings.config import CurveConfig

log = structlog.get_logger("supervisor")

__all__ = ["ThreadAuthenticator", "enable_curve_server"]


def enable_curve_server(context: zmq.Context[Any], socket: zmq.Socket[Any], curve: CurveConfig) -> ThreadAuthenticator:
    """Make `socket` a CURVE server that admits only the public keys in `curve.authorized_clients`.

    Must run before bind; returns the ZAP authenticator thread, which the caller stops on exit.
    """
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=curve.authorized_clients)
    public, secret = zmq.auth.load_certificate(curve.server_secret_key)
    if secret is None:
        raise ValueError(f"{curve.server_secret_key} holds no secret key")
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    log.info("curve_enabled", authorized_clients=curve.authorized_clients)
    return authenticator
