"""The retry policy of every kind as tables: each row is what the owner knew of an ended child, and its verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infervisor.protocol.constants import WorkerExitCode
from infervisor.supervisor.lifecycle.exit_decision import (
    BuildExitFacts,
    Charge,
    ChildExitFacts,
    ExitFacts,
    ExitVerdict,
    RequestOrder,
    Then,
    decide_build_exit,
    decide_child_exit,
    decide_exit,
)
from infervisor.supervisor.settings.config import Config, parse_config
from infervisor.supervisor.workers.retry_policy import ChildKind, retry_in
from infervisor.supervisor.workers.slot import RestartReason, SlotState

MODEL = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
LOAD_FAILED = int(WorkerExitCode.LOAD_FAILED)
CRASH, HANG, HEARTBEAT = RestartReason.CRASH, RestartReason.HANG, RestartReason.HEARTBEAT
SERVING, STARTING, DRAINING, STOPPING = SlotState.SERVING, SlotState.STARTING, SlotState.DRAINING, SlotState.STOPPING
BACKOFF, FAILED, STOPPED = SlotState.BACKOFF, SlotState.FAILED, SlotState.STOPPED
HEAD, SPLIT = Charge.HEAD, Charge.SPLIT
NOW, LATER, FAIL, DONE = Then.RESTART_NOW, Then.RESTART_LATER, Then.FAIL, Then.DONE
AUDIT, SHADOW, GATEWAY = ChildKind.AUDIT, ChildKind.SHADOW, ChildKind.GATEWAY


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


@pytest.mark.parametrize(
    ("case", "then"),
    [("drained worker leaves", DONE), ("first crash while serving", NOW), ("second crash while serving", LATER),
     ("third crash in the window", FAIL)],
)  # fmt: skip
def test_a_worker_verdict_in_every_kind_s_words(case: str, then: Then) -> None:
    """A worker's verdict says done, restart now, restart after back-off or fail, as every kind's does."""
    _, state, code, cause, repeated, hung, running, before, max_restarts, *_ = next(r for r in TABLE if r[0] == case)
    facts = ExitFacts(state, code, "how", cause, repeated, hung, running, before)
    assert decide_exit(facts, _config(max_restarts)).then is then


# A background builder. (case, code, attempts, profiles in the chain, profile it was on, its kills before) ->
# (then, kills of the profile after, passed on as an interruption)
BUILDER_TABLE = [
    ("built", 0, 1, 2, "jit", 0, DONE, None, False),
    ("exit code fails the build", 1, 1, 2, "jit", 0, FAIL, None, False),
    ("past its attempts", -9, 4, 2, "jit", 0, FAIL, None, False),
    ("last attempt still runs", -9, 3, 2, "jit", 0, NOW, 1, True),
    ("killed before a profile", -9, 1, 2, "", 0, NOW, None, False),
    ("first SIGKILL on a profile", -9, 1, 2, "jit", 0, NOW, 1, True),
    ("second SIGKILL on it", -9, 2, 2, "jit", 1, NOW, 2, False),
    ("native crash on a profile", -11, 1, 2, "jit", 0, NOW, 1, False),
]


@pytest.mark.parametrize("row", BUILDER_TABLE, ids=[row[0] for row in BUILDER_TABLE])
def test_the_verdict_on_each_kind_of_builder_exit(row: tuple[object, ...]) -> None:
    """Each end of a builder is done, failed, or started again with its profile blamed as the row says."""
    _, code, attempts, chain, profile, kills_before, then, kills, interrupted = row
    facts = BuildExitFacts(code, "how", attempts, chain, "building", profile, kills_before)  # type: ignore[arg-type]
    verdict = decide_build_exit(facts)
    assert (verdict.then, verdict.kills, verdict.interrupted) == (then, kills, interrupted)


def test_a_failed_build_says_where_its_builder_ended() -> None:
    """A failed build's reason names how the builder ended and the profile it was on, or that it was starting."""
    on_jit = decide_build_exit(BuildExitFacts(1, "exit 1", 1, 2, "building", "jit", 0))
    assert on_jit.why == "the builder ended with exit 1 while building jit"
    starting = decide_build_exit(BuildExitFacts(1, "exit 1", 1, 2, "", "", 0))
    assert starting.why == "the builder ended with exit 1 while starting"


# An audit or shadow process, the OIP gateway. (case, kind, how it ended (None: it lives), ends in a row before, ends
# before, ran for, samples waiting, oldest sent for, stopped for, no CPU for) -> (then (None: it keeps running), the
# back-off read at this many ends in a row, killed first)
CHILD_TABLE = [
    ("audit within its limits", AUDIT, None, 0, 0, None, 2, 299.0, 2.0, 59.0, None, 0, False),
    ("audit crashed", AUDIT, "killed by SIGSEGV", 0, 4, None, 0, None, None, None, LATER, 1, False),
    ("audit's third end in a row", AUDIT, "exit 1", 2, 2, None, 0, None, None, None, LATER, 3, False),
    ("audit could not start", AUDIT, "could not start: no pids", 0, 0, None, 1, None, None, None, LATER, 1, False),
    ("audit stopped while samples wait", AUDIT, None, 0, 0, None, 1, None, 3.0, 3.0, LATER, 1, True),
    ("audit without CPU time", AUDIT, None, 1, 1, None, 1, None, None, 60.0, LATER, 2, True),
    ("audit hung on a sample", AUDIT, None, 0, 0, None, 1, 301.0, None, 0.0, LATER, 1, True),
    ("audit back-off is capped", AUDIT, "exit 1", 30, 30, None, 0, None, None, None, LATER, 31, False),
    ("shadow is never judged stuck", SHADOW, None, 0, 0, None, 1, None, 60.0, 600.0, None, 0, False),
    ("shadow hung on a sample", SHADOW, None, 0, 0, None, 1, 301.0, None, None, LATER, 1, True),
    ("shadow's second end", SHADOW, "exit 1", 1, 1, None, 0, None, None, None, LATER, 2, False),
    ("shadow's third end gives up", SHADOW, "exit 1", 2, 2, None, 0, None, None, None, FAIL, 3, False),
    ("gateway crashed soon after its start", GATEWAY, "exit 1", 2, 2, 5.0, 0, None, None, None, LATER, 3, False),
    ("gateway ran long enough to start afresh", GATEWAY, "exit 1", 4, 4, 60.0, 0, None, None, None, LATER, 1, False),
    ("gateway could not start", GATEWAY, "could not start: x", 2, 2, None, 0, None, None, None, LATER, 3, False),
]


@pytest.mark.parametrize("row", CHILD_TABLE, ids=[row[0] for row in CHILD_TABLE])
def test_the_verdict_on_each_kind_of_child_exit(row: tuple[object, ...]) -> None:
    """Each end (or hang, or stall) of an audit, shadow or gateway process gets its kind's back-off, or is given up."""
    _, kind, how, in_row, ends, ran_s, waiting, oldest, stopped, stalled, then, backoff_at, kill = row
    facts = ChildExitFacts(kind, how, in_row, ends, ran_s, waiting, oldest, stopped, stalled)  # type: ignore[arg-type]
    verdict = decide_child_exit(facts)
    if then is None:
        assert verdict is None
        return
    assert verdict is not None and (verdict.then, verdict.ends_in_row, verdict.kill) == (then, backoff_at, kill)
    assert verdict.restart_in == retry_in(kind, backoff_at)  # type: ignore[arg-type]


def test_a_child_s_end_says_why_for_operators() -> None:
    """A killed process's last exit says it was stuck or hung, and a restart says when."""
    stopped = decide_child_exit(ChildExitFacts(AUDIT, None, 0, waiting=2, stopped_s=4.0, stalled_s=4.0))
    assert stopped is not None and stopped.how == "stuck: stopped for 4 s with 2 samples waiting: killed"
    hung = decide_child_exit(ChildExitFacts(SHADOW, None, 0, waiting=1, oldest_sent_s=400.0))
    assert hung is not None and hung.how == "no verdict for 300 s: ended as hung"
    crashed = decide_child_exit(ChildExitFacts(GATEWAY, "exit 1", 0, ran_s=1.0))
    assert crashed is not None and crashed.why == f"exit 1; restart in {retry_in(GATEWAY, 1):.1f} s"
