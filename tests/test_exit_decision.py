"""The retry policy as a table: each row is what the pool knew of an ended worker, and the verdict it gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infervisor.protocol.constants import WorkerExitCode
from infervisor.supervisor.lifecycle.exit_decision import Charge, ExitFacts, ExitVerdict, RequestOrder, decide_exit
from infervisor.supervisor.settings.config import Config, parse_config
from infervisor.supervisor.workers.slot import RestartReason, SlotState

MODEL = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
LOAD_FAILED = int(WorkerExitCode.LOAD_FAILED)
CRASH, HANG, HEARTBEAT = RestartReason.CRASH, RestartReason.HANG, RestartReason.HEARTBEAT
SERVING, STARTING, DRAINING, STOPPING = SlotState.SERVING, SlotState.STARTING, SlotState.DRAINING, SlotState.STOPPING
BACKOFF, FAILED, STOPPED = SlotState.BACKOFF, SlotState.FAILED, SlotState.STOPPED
HEAD, SPLIT = Charge.HEAD, Charge.SPLIT


def _config(max_restarts: int) -> Config:
    text = json.dumps({"max_restarts": max_restarts, "restart_window_s": 60, "models": {"tiny": MODEL}})
    return parse_config(text, Path("/nonexistent"))


# (case, state, code, cause, repeated load error, hung, running, failures before, max_restarts) ->
# (state, respawn in, counts, restart reason, charge, failures)
TABLE = [
    ("drained worker leaves", DRAINING, 0, CRASH, False, False, 0, 0, 3, STOPPED, None, False, None, HEAD, 0),
    ("stopped mid-batch", STOPPING, -9, CRASH, False, False, 3, 2, 3, STOPPED, None, False, None, SPLIT, 2),
    ("first crash while serving", SERVING, -11, CRASH, False, False, 1, 0, 3, BACKOFF, 0.0, True, CRASH, HEAD, 1),
    ("second crash while serving", SERVING, -11, CRASH, False, False, 0, 1, 3, BACKOFF, 1.0, True, CRASH, HEAD, 2),
    ("third crash in the window", SERVING, -11, CRASH, False, False, 1, 2, 3, FAILED, None, True, None, HEAD, 3),
    ("never ready, first exit", STARTING, 1, CRASH, False, False, 0, 0, 3, BACKOFF, 1.0, True, CRASH, HEAD, 1),
    ("never ready, second exit", STARTING, 1, CRASH, False, False, 0, 1, 3, BACKOFF, 2.0, True, CRASH, HEAD, 2),
    ("load failed once", STARTING, LOAD_FAILED, CRASH, False, False, 0, 0, 3, BACKOFF, 1.0, True, CRASH, HEAD, 1),
    ("same load error twice", STARTING, LOAD_FAILED, CRASH, True, False, 0, 0, 3, FAILED, None, True, None, HEAD, 2),
    ("killed for a hang", SERVING, -9, HANG, False, True, 1, 1, 3, BACKOFF, 0.0, True, HANG, HEAD, 2),
    ("hang ends the window", SERVING, -9, HANG, False, True, 1, 2, 3, FAILED, None, True, None, HEAD, 3),
    ("hung batch is split", SERVING, -9, HANG, False, True, 4, 0, 3, BACKOFF, 0.0, True, HANG, SPLIT, 1),
    ("batch death never fails", SERVING, -11, CRASH, False, False, 2, 2, 3, BACKOFF, 0.0, False, CRASH, SPLIT, 2),
    ("silent worker", SERVING, -9, HEARTBEAT, False, False, 0, 0, 3, BACKOFF, 0.0, True, HEARTBEAT, HEAD, 1),
    ("back-off is capped", STARTING, 1, CRASH, False, False, 0, 7, 100, BACKOFF, 30.0, True, CRASH, HEAD, 8),
]


@pytest.mark.parametrize("row", TABLE, ids=[row[0] for row in TABLE])
def test_the_verdict_on_each_kind_of_exit(row: tuple[object, ...]) -> None:
    """Each kind of exit gets its state, respawn time, count, restart reason and order for the broker."""
    _, state, code, cause, repeated, hung, running, before, max_restarts, *expected = row
    facts = ExitFacts(state, code, "how", cause, repeated, hung, running, before)  # type: ignore[arg-type]
    verdict = decide_exit(facts, _config(max_restarts))  # type: ignore[arg-type]
    new_state, respawn_in, counts, restart, charge, failures = expected
    assert (verdict.state, verdict.respawn_in, verdict.counts, verdict.restart) == (
        new_state,
        respawn_in,
        counts,
        restart,
    )
    assert verdict.requests == RequestOrder(charge, slot_failed=new_state is FAILED)  # type: ignore[arg-type]
    assert verdict.failures == failures


def test_the_reason_says_why_for_operators() -> None:
    """A failed slot's reason names the count and the window, a repeated load error says it is not retried."""
    crash = ExitFacts(SERVING, -11, "killed by SIGSEGV", CRASH, False, False, 1, 2)
    assert decide_exit(crash, _config(3)).why == "3 failures within 60 s; last: killed by SIGSEGV"
    twice = ExitFacts(STARTING, LOAD_FAILED, "load failed: no file", CRASH, True, False, 0, 0)
    verdict: ExitVerdict = decide_exit(twice, _config(3))
    assert verdict.why == "load failed: no file (twice in a row: not retried until a reload or restart)"
    later = ExitFacts(STARTING, 1, "exited with 1", CRASH, False, False, 0, 1)
    assert decide_exit(later, _config(3)).why == "exited with 1; respawn in 2.0 s"


def test_a_worker_that_answered_requests_is_respawned_at_once_however_many_ended_before() -> None:
    """A serving worker that answered a request respawns at once at its second crash; one that answered none, and
    one that never got ready, still back off; the window's limit still fails the slot."""
    answered = ExitFacts(SERVING, -9, "killed by SIGKILL", CRASH, False, False, 0, 2, answered=1)
    assert (decide_exit(answered, _config(5)).state, decide_exit(answered, _config(5)).respawn_in) == (BACKOFF, 0.0)
    silent = ExitFacts(SERVING, -9, "killed by SIGKILL", CRASH, False, False, 0, 2, answered=0)
    assert decide_exit(silent, _config(5)).respawn_in == 2.0
    starting = ExitFacts(STARTING, 1, "exited with 1", CRASH, False, False, 0, 1, answered=3)
    assert decide_exit(starting, _config(5)).respawn_in == 2.0
    assert decide_exit(answered, _config(3)).state is FAILED
