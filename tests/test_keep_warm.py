"""keep_warm_ms: the broker rehearses its per-request path on canned messages while a worker holds a request."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from protocol import worker_messages as wm
from protocol.client_messages import decode_infer
from protocol.tensors import TensorDesc
from supervisor.broker import Broker
from supervisor.config import ConfigError, parse_config
from supervisor.rehearsal import Rehearsal
from tests.conftest import TINY_INPUTS, Daemon, model_entry, wait_for
from tests.slow_model import SLOW_INPUTS, rounds, write_slow_model

IMAGE_INPUTS = [{"name": "image", "dtype": "float32", "shape": [None, 3, 224, 224]}]


def _config(inputs: list[dict[str, Any]], **top: Any) -> Any:
    return parse_config(json.dumps({"models": {"m": model_entry({"builtin": "resnet18"}, inputs)}, **top}), Path("."))


@pytest.mark.parametrize("value", [0, 11, True, "1", 1.5])
def test_keep_warm_ms_out_of_range_is_a_problem(value: object) -> None:
    """keep_warm_ms is an integer of 1..10 milliseconds, or null (the default: off)."""
    assert _config(IMAGE_INPUTS).keep_warm_ms is None
    assert _config(IMAGE_INPUTS, keep_warm_ms=10).keep_warm_ms == 10
    with pytest.raises(ConfigError, match="keep_warm_ms"):
        _config(IMAGE_INPUTS, keep_warm_ms=value)


def test_a_rehearsal_checks_a_request_of_the_models_spec_and_crosses_its_own_socketpair() -> None:
    """The canned request passes admission's checks (dynamic dims as 1); run() sends, reads, decodes both messages."""
    config = _config(IMAGE_INPUTS)
    rehearsal = Rehearsal(config.models["m"], config.max_frame_bytes)
    request = decode_infer(rehearsal.header, rehearsal.frame_lengths, config.max_frame_bytes)
    assert request.model == "m" and request.inputs == (TensorDesc("image", "float32", (1, 3, 224, 224)),)
    assert wm.decode(rehearsal.reply[0]) == wm.Reply(0, None, "")
    for _ in range(3):
        rehearsal.run()
    assert rehearsal.receiver.receive() == []  # each run read back everything it sent
    rehearsal.close()
    assert rehearsal.sender.fileno() == -1 and rehearsal.receiver.fileno() == -1


def test_a_failing_rehearsal_stops_with_its_error_until_a_new_config(tmp_path: Path) -> None:
    """A canned request admission refuses (input over max_frame_bytes) is reported once and not rebuilt until reload."""
    inputs = [{"name": "image", "dtype": "float32", "shape": [1, 3, 224, 224]}]
    config = _config(inputs, keep_warm_ms=1, max_frame_bytes=1024)
    context: zmq.Context[Any] = zmq.Context()
    broker = Broker(context, config, tmp_path)
    try:
        broker.reconcile_rehearsal()
        assert broker.rehearsal is not None
        broker.rehearse()
        assert broker.rehearsal is None and broker.rehearsals == 0
        assert broker.rehearsal_error is not None and "limit 1024" in broker.rehearsal_error
        broker.reconcile_rehearsal()
        assert broker.rehearsal is None  # not rebuilt to fail again every millisecond
        broker.config, broker.rehearsal_error = _config(IMAGE_INPUTS, keep_warm_ms=1), None  # what a reload does
        broker.reconcile_rehearsal()
        assert broker.rehearsal is not None
        broker.rehearse()
        assert broker.rehearsals == 1 and broker.rehearsal_error is None
    finally:
        broker.close()
        context.term()


def _keep_warm(daemon: Daemon) -> dict[str, Any]:
    status: dict[str, Any] = daemon.status()["keep_warm"]
    return status


def test_the_broker_rehearses_while_a_worker_holds_a_request_and_stops_when_reloaded_off(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """With keep_warm_ms 1 a long request sees rehearsals, at most one per idle millisecond; null stops them live."""
    path = write_slow_model(tmp_path)
    config = {
        "keep_warm_ms": 1,
        "models": {
            "slow": model_entry({"torchscript": str(path)}, SLOW_INPUTS),
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
        },
    }
    daemon = start_daemon(config)
    daemon.wait_ready()
    assert _keep_warm(daemon) == {"ms": 1, "model": "slow", "rehearsals": 0, "error": None}  # the first model's
    with daemon.client() as client:
        before, started = _keep_warm(daemon)["rehearsals"], time.monotonic()
        out, timing = client.infer_with_timing("slow", rounds(150), timeout=60)
        after, elapsed_ms = _keep_warm(daemon)["rehearsals"], (time.monotonic() - started) * 1000
        (output,) = out.values()
        assert output[0, 0] == pytest.approx(150.0, abs=1.0)
        # Only while the request was held, and only after an idle millisecond each.
        assert max(5, timing["model_ms"] / 10) <= after - before <= elapsed_ms + 1
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)

        config["keep_warm_ms"] = None
        daemon.write_config(config)
        wait_for(lambda: _keep_warm(daemon)["model"] is None, 30, "rehearsal let go after the reload")
        held = _keep_warm(daemon)
        assert held["ms"] is None and held["error"] is None
        client.infer("slow", rounds(150), timeout=60)
        assert _keep_warm(daemon)["rehearsals"] == held["rehearsals"]
