"""The live audit with real workers: a jit profile exact on its validation rows and 5% off elsewhere
(tests.evidence_models.OffWhenTraced) is caught on live traffic and falls back, or is only reported; the audit
process is contained (kill -9 restarts it, serving goes on), and nothing is audited without budget or on eager."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from infervisor.protocol.client import Client
from infervisor.supervisor.commands.status import format_status
from infervisor.supervisor.settings.audit_keys import AuditAction, AuditConfig
from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import Daemon, model_entry, wait_for
from tests.evidence_models import OFF_INPUTS

SOURCE = {"python": "tests.evidence_models:off_when_traced"}
#: A high budget, so the tests catch fast; the default's catch time is measured by bench/audit.py.
FAST = {"budget": 0.5}


def _rows(first: float, seed: int, count: int = 1) -> np.ndarray:
    """Rows of N(0, 1) with the first value set: jit is exact where it is at most 0, 5% off where it is 1 or more."""
    rows = np.random.default_rng(seed).standard_normal((count, 8)).astype(np.float32)
    rows[:, 0] = first
    return rows


def _validation(tmp_path: Path) -> str:
    """A validation set jit passes exactly (every first value at most 0)."""
    path = tmp_path / "validation.npz"
    np.savez(path, x=np.concatenate([_rows(-0.5, seed, 2) for seed in range(4)]))
    return str(path)


def _entry(validation: str, **extra: Any) -> dict[str, Any]:
    return model_entry(SOURCE, OFF_INPUTS, profiles=["jit", "eager"], validation=validation, **extra)


def _send_until(daemon: Daemon, client: Client, model: str, first: float, done: Callable[[dict[str, Any]], Any],
                timeout: float, what: str) -> dict[str, Any]:  # fmt: skip
    """Send requests of `model` (first value `first`) until `done(status)`; every answer must be a success."""
    seed = 0

    def sent_and_done() -> dict[str, Any] | None:
        nonlocal seed
        for _ in range(5):
            seed += 1
            client.infer(model, {"x": _rows(first, seed)}, timeout=30.0)
        status = daemon.status()
        return status if done(status) else None

    return wait_for(sent_and_done, timeout, what, interval=0.05)  # type: ignore[no-any-return]


def _audit_pids(daemon: Daemon) -> list[int]:
    """The daemon's audit processes, as the OS sees them."""
    pids = []
    for pid in daemon.worker_pids():
        try:
            # A child forked from the warm template shows its command as one title (setproctitle).
            if "infervisor.worker.audit" in " ".join(psutil.Process(pid).cmdline()).split():
                pids.append(pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def test_the_audit_catches_an_off_profile_and_falls_back_or_only_reports(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """jit passes its gate on exact rows; traffic where it is 5% off makes `fallback` move to eager with the audit's
    reason (row, cosine, tolerance, input shape), recorded in the cache so that a restarted daemon never serves jit for
    that spec again, while `report` keeps serving jit and counts the rows below (and records nothing itself)."""
    validation = _validation(tmp_path)
    config = {"oversubscribe": True, "cache_dir": str(tmp_path / "cache"), "models": {
        "fb": _entry(validation, audit=FAST),
        "rep": _entry(validation, audit={**FAST, "action": "report"}),
    }}  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(240)
    assert status["models"]["fb"]["serving"] == ["jit"] and status["models"]["rep"]["serving"] == ["jit"], status
    with daemon.client() as client:
        # Exact traffic first: audited, nothing below tolerance.
        before = _send_until(daemon, client, "fb", -1.0, lambda s: s["models"]["fb"]["audit"]["rows_audited"] >= 3,
                             120, "exact rows audited")  # fmt: skip
        audit = before["models"]["fb"]["audit"]
        assert audit["rows_below_tolerance"] == 0 and audit["process"]["state"] == "ready", audit
        assert audit["worst"]["cosine"] > 0.99999, audit
        print("BEFORE\n" + format_status(before, notes=False))
        fallen = _send_until(daemon, client, "fb", 1.5, lambda s: (s["models"]["fb"].get("fallback") or {}).get(
            "origin") == "audit", 120, "the audit's fallback")  # fmt: skip
        reported = _send_until(daemon, client, "rep", 1.5,
                               lambda s: s["models"]["rep"]["audit"]["rows_below_tolerance"] >= 2, 120,
                               "rows below tolerance reported")  # fmt: skip
    fallback = fallen["models"]["fb"]["fallback"]
    assert fallback["from"] == "jit" and fallback["profiles"] == ["eager"], fallback
    reason = fallback["reason"]
    assert "live audit: jit answered row 0" in reason and "x[1, 8]" in reason, reason
    assert "cosine 0.998" in reason and "min_cosine 0.999" in reason, reason
    finding = fallen["models"]["fb"]["audit"]["last_finding"]
    assert finding["profile"] == "jit" and finding["input_shape"] == "x[1, 8]" and finding["cosine"] < 0.999, finding
    after = wait_for(lambda: (s := daemon.status())["models"]["fb"]["serving"] == ["eager"] and s, 120, "eager serves")
    # Eager serves: nothing is left to audit, its process is gone.
    wait_for(lambda: daemon.status()["models"]["fb"]["audit"]["process"]["state"] == "off", 30, "fb's audit off")
    print("AFTER\n" + format_status(after, notes=False))
    assert "audit: " in format_status(after, notes=False)
    rep = reported["models"]["rep"]
    assert rep["serving"] == ["jit"] and rep.get("fallback") is None, rep
    assert rep["audit"]["last_finding"]["failure"].startswith("cosine 0.998"), rep["audit"]
    refusals = wait_for(lambda: daemon.status()["models"]["fb"]["refusals"], 30, "fb's refusal listed")
    assert refusals["jit"]["by"] == "live audit" and refusals["jit"]["input_shape"] == "x[1, 8]", refusals
    assert daemon.status()["models"]["rep"]["refusals"] is None
    daemon.stop()
    again = start_daemon(config).wait_ready(240)
    # `rep` is the same weights, inputs and tolerance: one spec key, so fb's verdict on jit holds for it too.
    for name in ("fb", "rep"):
        assert again["models"][name]["serving"] == ["eager"], again["models"][name]
        skipped = again["models"][name]["workers"][0]["profile_skipped"]
        assert any(s.startswith("jit: refused by live audit on live traffic") for s in skipped), skipped


def test_a_killed_or_stopped_audit_process_is_restarted_and_serving_never_notices(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """kill -9 of the audit process: every request still succeeds, status counts the restart, a new one audits.
    SIGSTOP of the next one while samples wait: it is found stuck, shown so (not `ready`, then its last exit),
    killed and replaced by one that audits."""
    daemon = start_daemon({"models": {"m": _entry(_validation(tmp_path), audit=FAST)}})
    daemon.wait_ready(240)
    with daemon.client() as client:
        ready = _send_until(daemon, client, "m", -1.0, lambda s: s["models"]["m"]["audit"]["rows_audited"] >= 1,
                            120, "a first audit")  # fmt: skip
        first = ready["models"]["m"]["audit"]["process"]["pid"]
        os.kill(first, signal.SIGKILL)
        again = _send_until(daemon, client, "m", -1.0, lambda s: (a := s["models"]["m"]["audit"])["process"][
            "restarts"] >= 1 and a["process"]["state"] == "ready", 120, "the audit restarted")  # fmt: skip
        audited = again["models"]["m"]["audit"]["rows_audited"]
        _send_until(daemon, client, "m", -1.0, lambda s: s["models"]["m"]["audit"]["rows_audited"] > audited, 120,
                    "audits after the restart")  # fmt: skip
        process = again["models"]["m"]["audit"]["process"]
        assert process["pid"] != first and process["last_exit"] == "killed by SIGKILL", process
        stopped = _stop_audit_process(daemon, client, process["pid"])
    assert "stuck: stopped for" in stopped["last_exit"] and "samples waiting: killed" in stopped["last_exit"], stopped
    assert stopped["restarts"] >= 2 and stopped["state"] == "ready", stopped
    status = daemon.status()["models"]["m"]
    assert status["errors"] == {} and status["serving"] == ["jit"] and status["audit"]["rows_below_tolerance"] == 0


def _stop_audit_process(daemon: Daemon, client: Client, pid: int) -> dict[str, Any]:
    """SIGSTOP the audit process `pid` and send until another one is ready: that one's status, once a state other
    than `ready` was seen meanwhile and `pid` is gone (a daemon that never notices leaves it stopped: killed here)."""
    process = psutil.Process(pid)
    process.suspend()  # SIGSTOP
    seen: set[str] = set()

    def replaced(status: dict[str, Any]) -> dict[str, Any] | None:
        now: dict[str, Any] = status["models"]["m"]["audit"]["process"]
        seen.add(now["state"])
        return now if now["pid"] not in (None, pid) and now["state"] == "ready" else None

    try:
        status = _send_until(daemon, client, "m", -1.0, replaced, 120, "the stopped audit process replaced")
        wait_for(lambda: not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, 10, "it is gone")
    finally:
        if process.is_running():  # psutil checks the start time: never another process that took the pid
            process.kill()
    assert seen - {"ready"}, seen
    return replaced(status) or {}


def test_a_fast_model_is_sampled_at_most_once_a_second_whatever_its_budget(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A whole core of budget on a millisecond model: still one sample a second (a fast model's P99 feels each)."""
    daemon = start_daemon({"models": {"m": _entry(_validation(tmp_path), audit={"budget": 1.0})}})
    daemon.wait_ready(240)
    with daemon.client() as client:
        before = _send_until(daemon, client, "m", -1.0, lambda s: s["models"]["m"]["audit"]["rows_audited"] >= 1,
                             120, "a first audit")  # fmt: skip
        sent = 0
        window_ends = time.monotonic() + 3.0
        while time.monotonic() < window_ends:  # bounded by time: as many requests as the daemon answers in 3 s
            client.infer("m", {"x": _rows(-1.0, sent)}, timeout=30.0)
            sent += 1
    after = daemon.status()
    audited = after["models"]["m"]["audit"]["rows_audited"] - before["models"]["m"]["audit"]["rows_audited"]
    elapsed = after["uptime_s"] - before["uptime_s"]
    # One more than the seconds elapsed: the sample in flight when the window began is counted in it.
    assert audited <= elapsed + 2, (audited, elapsed, sent)
    assert sent > 10 * (elapsed + 2), f"too few requests ({sent}) to tell the cap from the budget"


def test_no_audit_without_budget_nor_on_an_eager_model(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """budget 0 on jit, and the default budget on an eager-served model: answers are served, no audit process runs."""
    validation = _validation(tmp_path)
    config = {"oversubscribe": True, "models": {
        "off": _entry(validation, audit={"budget": 0}),
        "plain": model_entry(SOURCE, OFF_INPUTS, profiles=["eager"]),
    }}  # fmt: skip
    daemon = start_daemon(config)
    daemon.wait_ready(240)
    with daemon.client() as client:
        for seed in range(20):
            for model in ("off", "plain"):
                client.infer(model, {"x": _rows(1.5, seed)}, timeout=30.0)
    since = daemon.status()["uptime_s"]

    def three_quiet_turns() -> bool:  # three monitor turns, in which a process would have been started
        assert _audit_pids(daemon) == []
        return bool(daemon.status()["uptime_s"] > since + 3.0)

    wait_for(three_quiet_turns, 30, "three monitor turns")
    status = daemon.status()["models"]
    assert status["off"]["audit"] is None and status["off"]["serving"] == ["jit"], status["off"]
    plain = status["plain"]["audit"]
    assert plain["rows_audited"] == 0 and plain["process"]["state"] == "off", plain


def _audit_key(value: object, tmp_path: Path) -> AuditConfig:
    entry: dict[str, object] = {
        "source": {"builtin": "tiny"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}],
    }
    if value is not None:
        entry["audit"] = value
    config = parse_config(json.dumps({"models": {"m": entry}}), tmp_path)
    return config.models["m"].audit


def test_the_audit_key_defaults_on_and_refuses_what_it_cannot_mean(tmp_path: Path) -> None:
    """Absent: 2% of a core and fallback; a budget past one core, a negative one or an unknown action is refused."""
    assert _audit_key(None, tmp_path) == AuditConfig(0.02, AuditAction.FALLBACK)
    assert _audit_key({"budget": 0}, tmp_path).budget == 0
    assert _audit_key({"action": "report"}, tmp_path) == AuditConfig(0.02, AuditAction.REPORT)
    for bad, path in (({"budget": 1.5}, "budget"), ({"budget": -0.1}, "budget"), ({"action": "kill"}, "action"),
                      ({"every": 3}, "every"), ("on", "audit")):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            _audit_key(bad, tmp_path)
        assert any("models.m.audit" in p and path in p for p in info.value.problems), info.value.problems


def _write_scripted(path: Path, seed: int) -> None:
    """A TorchScript file of Linear(8, 16) + tanh with weights drawn from `seed`."""
    import torch

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()).eval()
    torch.jit.script(module).save(str(path))  # type: ignore[no-untyped-call]


def test_a_changed_model_file_is_audited_against_its_new_weights(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """New weights on disk: the workers and the audit process both load them, and the old weights' eager never
    judges the new answers (no row below tolerance, no fallback)."""
    path = tmp_path / "model.pt"
    _write_scripted(path, seed=1)
    entry = model_entry({"torchscript": str(path)}, OFF_INPUTS, profiles=["jit", "eager"], audit=FAST)
    daemon = start_daemon({"models": {"m": entry}})
    worker = daemon.wait_ready(240)["models"]["m"]["workers"][0]["pid"]
    with daemon.client() as client:
        first = _send_until(daemon, client, "m", -1.0, lambda s: s["models"]["m"]["audit"]["rows_audited"] >= 2,
                            120, "audits of the first weights")  # fmt: skip
        audit_pid = first["models"]["m"]["audit"]["process"]["pid"]
        _write_scripted(path, seed=2)
        os.utime(path)

        def new_weights_audited(status: dict[str, Any]) -> bool:
            model = status["models"]["m"]
            pids = [w["pid"] for w in model["workers"] if w["state"] == "serving"]
            audit = model["audit"]
            return bool(pids and worker not in pids and audit["process"]["pid"] not in (None, audit_pid)
                        and audit["rows_audited"] >= first["models"]["m"]["audit"]["rows_audited"] + 3)  # fmt: skip

        after = _send_until(daemon, client, "m", -1.0, new_weights_audited, 180, "the new weights audited")
    model = after["models"]["m"]
    assert model["audit"]["rows_below_tolerance"] == 0 and model.get("fallback") is None, model["audit"]
    assert model["serving"] == ["jit"], model
