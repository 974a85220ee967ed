"""Admission control: a full queue answers OVERLOADED at once; a queued request past its deadline expires."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from infervisor.protocol import ErrorCode, InferenceError
from tests.conftest import Daemon, model_entry, wait_for
from tests.slow_model import SLOW_INPUTS, rounds, write_slow_model


def _busy(daemon: Daemon) -> bool:
    return bool(daemon.status()["models"]["slow"]["workers"][0]["busy"])


def _queued(daemon: Daemon) -> int:
    return int(daemon.status()["models"]["slow"]["queued"])


def _call(daemon: Daemon, n: int, **kwargs: Any) -> dict[str, Any]:
    with daemon.client() as client:
        return client.infer("slow", rounds(n), timeout=60, **kwargs)


@pytest.fixture
def slow_daemon(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """One worker of the burn model with a queue of one.

    The hang budget is far above the burn's seconds: on a box shared with other work a long burn is still progress,
    and these tests are about admission, not about hang detection.
    """
    path = write_slow_model(tmp_path)
    entry = model_entry({"torchscript": str(path)}, SLOW_INPUTS, queue_size=1)
    daemon = start_daemon({"hang_min_s": 300, "models": {"slow": entry}})
    daemon.wait_ready()
    return daemon


def test_full_queue_answers_overloaded_while_work_is_in_flight(slow_daemon: Daemon) -> None:
    """With the worker busy and the queue full, a third request is refused before the first finishes."""
    with ThreadPoolExecutor(3) as pool:
        first: Future[dict[str, Any]] = pool.submit(_call, slow_daemon, 6000)
        wait_for(lambda: _busy(slow_daemon), 30, "worker busy")
        second = pool.submit(_call, slow_daemon, 1)
        wait_for(lambda: _queued(slow_daemon) == 1, 30, "one request queued")
        with pytest.raises(InferenceError) as caught:
            _call(slow_daemon, 1)
        assert caught.value.code == ErrorCode.OVERLOADED
        assert not first.done(), "OVERLOADED must come at once, not after the queue drains"
        assert first.result()["output"].shape == (1, 1)
        assert second.result()["output"].shape == (1, 1)
    assert slow_daemon.status()["models"]["slow"]["errors"] == {"OVERLOADED": 1}


def test_request_whose_deadline_passes_in_the_queue_gets_deadline_exceeded(slow_daemon: Daemon) -> None:
    """A queued request with a 100 ms deadline is answered DEADLINE_EXCEEDED while the worker is still busy."""
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_call, slow_daemon, 6000)
        wait_for(lambda: _busy(slow_daemon), 30, "worker busy")
        with pytest.raises(InferenceError) as caught:
            _call(slow_daemon, 1, deadline_ms=100)
        assert caught.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert not first.done()
        assert first.result()["output"].shape == (1, 1)
