"""The live fallback: a model moved down its validated chain by the operator or by repeated canary mismatches."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for
from tests.fault_models import FAULT_INPUTS
from tests.test_operations import Load

DRIFTS = {"python": "tests.fault_models:drifts_when_traced"}


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infervisor", *args, "--runtime-dir", str(daemon.runtime_dir)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip


def _workers(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    return [w for w in daemon.status()["models"][model]["workers"] if "role" not in w]


def test_fallback_under_load_fails_nothing_survives_a_reload_and_resets(start_daemon: Callable[..., Daemon]) -> None:
    """`fallback` rolls both workers from jit to eager under load, a live reload keeps it, `--reset` brings jit back."""
    config = {
        "oversubscribe": True,
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=2, profiles=["jit", "eager"])},
    }
    daemon = start_daemon(config)
    before = daemon.wait_ready()["models"]["tiny"]["workers"]
    assert [w["profile"] for w in before] == ["jit", "jit"], before
    x = np.random.default_rng(4).standard_normal((1, 16)).astype(np.float32)
    with Load(daemon, "tiny", {"x": x}, clients=2) as load:
        done = _cli(daemon, "fallback", "--model", "tiny", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        answer = json.loads(done.stdout)
        assert answer["profiles"] == ["eager"] and answer["from"] == "jit" and answer["rollout"]["state"] == "applied"
        workers = _workers(daemon, "tiny")
        assert [w["profile"] for w in workers] == ["eager", "eager"], workers
        assert not {w["pid"] for w in workers} & {w["pid"] for w in before}
        model = daemon.status()["models"]["tiny"]
        assert model["profiles"] == ["eager"], model
        fallback = model["fallback"]
        assert (fallback["state"], fallback["origin"], fallback["from"]) == ("in force", "operator", "jit"), fallback
        assert fallback["configured"] == ["jit", "eager"] and fallback["reason"] == "operator command"
        shown = _cli(daemon, "status").stdout
        assert "model tiny fallback in force" in shown and "instead of jit, eager, left jit" in shown, shown

        # A live edit of the same model keeps the fallback: the overlay is applied to every reload.
        config["models"]["tiny"]["queue_size"] = 32
        daemon.write_config(config)
        wait_for(lambda: daemon.status()["models"]["tiny"]["queue_size"] == 32, 60, "the live queue_size applied")
        assert {w["pid"] for w in _workers(daemon, "tiny")} == {w["pid"] for w in workers}, "nothing was rebuilt"
        assert daemon.status()["models"]["tiny"]["fallback"]["state"] == "in force"

        refused = _cli(daemon, "fallback", "--model", "tiny")
        assert refused.returncode == 1 and "nothing is below it" in refused.stderr, refused.stderr

        reset = _cli(daemon, "fallback", "--model", "tiny", "--reset")
        assert reset.returncode == 0, reset.stdout + reset.stderr
        assert "back to its configured chain" in reset.stdout
        served = load.ok
        wait_for(lambda: load.ok > served + 20, 60, "requests served after the reset")
    assert load.failures == [] and load.ok > 0
    model = daemon.status()["models"]["tiny"]
    assert [w["profile"] for w in _workers(daemon, "tiny")] == ["jit", "jit"]
    assert model["fallback"] is None and model["profiles"] == ["jit", "eager"], model
    events = [e for e in daemon.log_events() if e["event"] in ("model_fell_back", "fallback_reset_started")]
    assert [(e["event"], e["origin"]) for e in events] == [
        ("model_fell_back", "operator"),
        ("fallback_reset_started", "operator"),
    ], events


def test_a_canary_mismatch_that_repeats_on_the_replacement_falls_back(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """jit's numbers drift: the first mismatch recycles; the replacement's moves the model to eager, says so, and the
    refusal is recorded: the next start serves eager."""
    config = {
        "cache_dir": str(tmp_path / "cache"),
        "monitor_interval_s": 0.2,
        "oversubscribe": True,
        "models": {"drifts": model_entry(DRIFTS, FAULT_INPUTS, profiles=["jit", "eager"], canary_interval_s=0.5)},
    }
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    (first,) = daemon.wait_ready()["models"]["drifts"]["workers"]
    assert first["profile"] == "jit", first

    def fell_back() -> dict[str, Any] | None:
        fallback = daemon.status()["models"]["drifts"]["fallback"]
        return fallback if fallback and fallback["state"] == "in force" else None

    fallback = wait_for(fell_back, 180, "the model moved to eager by its canaries")
    assert fallback["origin"] == "canary" and fallback["from"] == "jit", fallback
    assert "canary_mismatch on jit repeated in pids" in fallback["reason"], fallback
    wait_for(lambda: [w["profile"] for w in _workers(daemon, "drifts")] == ["eager"], 60, "eager serving")
    wait_for(lambda: (_workers(daemon, "drifts")[0]["last_event"] or {}).get("monitor") == "canary_ok", 60,
             "eager passing its canaries")  # fmt: skip
    mismatches = [e for e in daemon.log_events() if e["event"] == "monitor_fired" and e["monitor"] == "canary_mismatch"]
    actions = [e["action"] for e in mismatches]
    assert actions[0] == "recycle" and actions.count("fallback") == 1, actions
    # The fallback came from a process other than the first one, both serving jit.
    (fired,) = [e for e in mismatches if e["action"] == "fallback"]
    assert fired["pid"] != first["pid"] and fired["earlier_pids"] == [first["pid"]] and fired["profile"] == "jit"
    (event,) = [e for e in daemon.log_events() if e["event"] == "model_fell_back"]
    assert event["origin"] == "canary" and event["profiles"] == ["eager"], event
    refusals = wait_for(lambda: daemon.status()["models"]["drifts"]["refusals"], 30, "jit's refusal listed")
    assert refusals["jit"]["by"] == "canary" and "repeated in pids" in refusals["jit"]["why"], refusals
    assert refusals["jit"]["max_abs_error"] > refusals["jit"]["limit"], refusals
    daemon.stop()
    # What the canaries proved stays proved: the next start never serves jit for this spec.
    again = start_daemon(config, env={"PYTHONPATH": str(ROOT)}).wait_ready()["models"]["drifts"]
    assert again["serving"] == ["eager"] and again.get("fallback") is None, again
    skipped = again["workers"][0]["profile_skipped"]
    assert any(s.startswith("jit: refused by canary on live traffic") for s in skipped), skipped
