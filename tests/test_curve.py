"""The tcp endpoint: loopback by default; CURVE keys admit only known clients (exercised on loopback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq.auth

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.protocol.client import Client
from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import TINY_INPUTS, Daemon, free_loopback_port, model_entry

MODELS = (
    '"models": {"tiny": {"source": {"builtin": "tiny"}, '
    '"inputs": [{"name": "x", "dtype": "float32", "shape": [1, 16]}]}}'
)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A server certificate, one authorized client, and one stranger, made with zmq.auth."""
    for folder in ("server", "clients", "stranger"):
        (tmp_path / folder).mkdir()
    server_public, server_secret = zmq.auth.create_certificates(tmp_path / "server", "server")
    Path(server_secret).chmod(0o600)  # pyzmq writes it 0644 under umask 022: refused as sshd refuses host keys
    client_public, client_secret = zmq.auth.create_certificates(tmp_path / "clients", "app")
    _, stranger_secret = zmq.auth.create_certificates(tmp_path / "stranger", "stranger")
    Path(client_secret).rename(tmp_path / "app.key_secret")  # the allow-list folder holds public keys only
    return {
        "server_public": Path(server_public),
        "server_secret": Path(server_secret),
        "clients": tmp_path / "clients",
        "client_secret": tmp_path / "app.key_secret",
        "stranger_secret": Path(stranger_secret),
    }


def test_non_loopback_tcp_needs_curve(keys: dict[str, Path]) -> None:
    """tcp on a non-loopback address is refused without CURVE keys and accepted with them."""
    with pytest.raises(ConfigError) as caught:
        parse_config('{"tcp_endpoint": "tcp://0.0.0.0:5555", ' + MODELS + "}", Path("."))
    assert any(p.startswith("tcp_endpoint:") and "curve" in p for p in caught.value.problems)
    curve = f'"curve": {{"server_secret_key": "{keys["server_secret"]}", "authorized_clients": "{keys["clients"]}"}}'
    config = parse_config('{"tcp_endpoint": "tcp://0.0.0.0:5555", ' + curve + ", " + MODELS + "}", Path("."))
    assert config.curve is not None and config.curve.authorized_clients == str(keys["clients"])
    with pytest.raises(ConfigError) as missing:
        parse_config(
            '{"curve": {"server_secret_key": "/nope", "authorized_clients": "/nope"}, ' + MODELS + "}", Path(".")
        )
    assert {p.split(":")[0] for p in missing.value.problems} == {"curve.server_secret_key", "curve.authorized_clients"}


def test_curve_admits_known_clients_only(start_daemon: Callable[..., Daemon], keys: dict[str, Path]) -> None:
    """A client with an authorized key is served over tcp; a stranger's key gets no answer; ipc is unaffected."""
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    config = {
        "tcp_endpoint": endpoint,
        "curve": {"server_secret_key": str(keys["server_secret"]), "authorized_clients": str(keys["clients"])},
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)},
    }
    daemon = start_daemon(config)
    daemon.wait_ready()
    server_public, _ = zmq.auth.load_certificate(keys["server_public"])
    x = {"x": np.ones((1, 16), np.float32)}
    app_keys = zmq.auth.load_certificate(keys["client_secret"])
    with Client(endpoint, server_public_key=server_public, client_keys=(app_keys[0], app_keys[1] or b"")) as client:
        assert client.infer("tiny", x, timeout=30)["y"].shape == (1, 16)
    stranger = zmq.auth.load_certificate(keys["stranger_secret"])
    with Client(endpoint, server_public_key=server_public, client_keys=(stranger[0], stranger[1] or b"")) as client:
        with pytest.raises(InferenceError) as caught:
            client.infer("tiny", x, timeout=2)
        assert caught.value.code == ErrorCode.TIMEOUT
    with Client(endpoint) as plain, pytest.raises(InferenceError):
        plain.infer("tiny", x, timeout=2)
    with daemon.client() as local:
        assert local.infer("tiny", x, timeout=30)["y"].shape == (1, 16)
    assert daemon.status()["models"]["tiny"]["completed"] == 2
