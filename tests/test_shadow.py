"""The evidence ladder with real workers: a lossy profile (bf16) serves only after matching the served exact answers
on live traffic in shadow; one exact on its validation rows and off on live inputs absent from them
(tests.evidence_models.OffInBf16) is refused in shadow with the row's figures, never answers a client, and stays
refused across a daemon restart, and on an empty cache filled by a signed bundle of the first, until
`fallback --reset`; the same profile on traffic it is right on switches, and serves at once after a restart on its
recorded evidence."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.common import verdicts
from infervisor.common.cpuinfo import read_caps
from infervisor.common.profiles import cpu_refusal
from infervisor.protocol.client import Client
from infervisor.supervisor.commands.status import format_status
from infervisor.supervisor.toolkit.bundle import export_bundle, import_bundle
from infervisor.supervisor.toolkit.bundle_keys import load_signing_key
from tests.bundle_fixtures import key_pair
from tests.conftest import Daemon, model_entry, wait_for
from tests.evidence_models import OFF_INPUTS, off_in_bf16

pytestmark = pytest.mark.skipif(cpu_refusal("bf16", read_caps()) is not None, reason="no native bf16 on this CPU")

SOURCE = {"python": "tests.evidence_models:off_in_bf16"}
#: A small shadow, so the test switches fast; its default (200 rows): bench/first_start.py; its cost: bench/shadow.py.
ROWS = 6


def _rows(first: float, seed: int) -> np.ndarray:
    """A row of N(0, 1) with its first value set: bf16 is within rounding where it is at most 0, far off from 1."""
    row = np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)
    row[:, 0] = first
    return row


def _eager(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return off_in_bf16()(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


def _config(tmp_path: Path) -> dict[str, Any]:
    validation = tmp_path / "validation.npz"
    np.savez(validation, x=np.concatenate([_rows(-0.5, seed) for seed in range(8)]))
    common = {"profiles": ["bf16", "eager"], "build": "background", "validation": str(validation),
              "shadow_rows": ROWS, "shadow_budget": 1.0}  # fmt: skip
    # Two tolerances: two spec keys, so each model's verdicts are its own although the weights are the same.
    return {"oversubscribe": True, "cache_dir": str(tmp_path / "cache"), "models": {
        "off": model_entry(SOURCE, OFF_INPUTS, **common),
        "good": model_entry(SOURCE, OFF_INPUTS, tolerance={"min_cosine": 0.998}, **common),
    }}  # fmt: skip


class Traffic:
    """Requests sent one by one; every answer is checked against eager fp32 on the spot."""

    def __init__(self, client: Client) -> None:
        self.client, self.seed, self.off = client, 0, 0

    def send(self, model: str, first: float) -> None:
        self.seed += 1
        x = _rows(first, self.seed)
        (got,) = self.client.infer(model, {"x": x}, timeout=30.0).values()
        if not np.allclose(got, _eager(x), rtol=1e-2, atol=1e-2):
            self.off += 1

    def until(self, daemon: Daemon, sends: Callable[[], None], done: Callable[[dict[str, Any]], bool],
              timeout: float, what: str) -> dict[str, Any]:  # fmt: skip
        def sent_and_done() -> dict[str, Any] | None:
            sends()
            status = daemon.status()
            return status if done(status) else None

        return wait_for(sent_and_done, timeout, what, interval=0.1)  # type: ignore[no-any-return]


def _when(daemon: Daemon, holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    status = daemon.status()
    return status if holds(status) else None


def _build(status: dict[str, Any], model: str) -> dict[str, Any]:
    return status["models"][model]["build"] or {}  # type: ignore[no-any-return]

def _serves_what_was_proven(daemon: Daemon) -> None:
    """`good` serves bf16 at its first answer (its evidence is recorded); `off` never serves it, under its traffic."""
    first = daemon.wait_ready(240)
    assert first["models"]["good"]["serving"] == ["bf16"], first["models"]["good"]
    assert first["models"]["off"]["serving"] == ["eager"], first["models"]["off"]
    with daemon.client() as client:
        traffic = Traffic(client)
        settled = traffic.until(daemon, lambda: traffic.send("off", 1.5),
                                lambda s: _build(s, "off").get("state") == "done", 240, "off's build done")  # fmt: skip
    assert traffic.off == 0 and settled["models"]["off"]["serving"] == ["eager"], settled["models"]["off"]
    assert _build(settled, "off")["refused"]["bf16"].startswith("refused by shadow"), _build(settled, "off")



def test_a_lossy_profile_off_on_live_inputs_is_refused_in_shadow_and_stays_refused_while_a_right_one_switches(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """bf16 passes its gate on both models; on `off`'s live traffic (first values 1.5) the shadow refuses it with the
    row's figures and no client gets a bf16 answer; on `good`'s (first values at most 0) it serves after ROWS rows.
    After a restart `off` never serves bf16 and `good` serves it from its first answer; `--reset` clears the refusal."""
    config = _config(tmp_path)
    daemon = start_daemon(config)
    status = daemon.wait_ready(240)
    assert status["models"]["off"]["serving"] == ["eager"], status["models"]["off"]
    # Built, and waiting for traffic in shadow: nothing switches without it.
    in_shadow = lambda s: all(_build(s, m).get("state") == "shadow" for m in ("off", "good"))  # noqa: E731
    waiting = wait_for(lambda: _when(daemon, in_shadow), 240, "both picks in shadow")
    assert "no traffic = no switch" in _build(waiting, "off")["summary"], _build(waiting, "off")
    assert _build(waiting, "off")["shadow"]["profile"] == "bf16", _build(waiting, "off")
    with daemon.client() as client:
        traffic = Traffic(client)
        mix = np.random.default_rng(0)  # exact rows and off rows, in no order the sampling could follow
        refused = traffic.until(daemon, lambda: [traffic.send("off", v) for v in mix.choice([-1.0, 1.5], 3)],
                                lambda s: _build(s, "off").get("state") == "done", 240,
                                "off's shadow refusal")  # fmt: skip
        switched = traffic.until(daemon, lambda: traffic.send("good", -1.0),
                                 lambda s: s["models"]["good"]["serving"] == ["bf16"], 240,
                                 "good switched to bf16")  # fmt: skip
        for _ in range(10):
            traffic.send("off", 1.5)
    assert traffic.off == 0, f"{traffic.off} answers off eager were served"
    shadow = _build(refused, "off")["shadow"]
    assert shadow["state"] == "refused" and shadow["verdict"]["input_shape"] == "x[1, 8]", shadow
    verdict = shadow["verdict"]
    if verdict.get("measure") == "gate":
        # Off rows recorded before the shadow process started: its own start's gate refused bf16 on them, the same
        # rows it would have compared (which path is taken depends on when the recorder's first write lands).
        assert "on recorded served inputs" in verdict["why"], shadow
    else:
        assert verdict["cosine"] < 0.999 and "off the served exact answer" in verdict["why"], shadow
    listed = wait_for(lambda: _when(daemon, lambda s: "bf16" in (s["models"]["off"]["refusals"] or {})),
                      30, "off's refusal listed")  # fmt: skip
    off = listed["models"]["off"]
    assert off["serving"] == ["eager"], off
    assert off["refusals"]["bf16"]["by"] == "shadow" and off["refusals"]["bf16"]["input_shape"] == "x[1, 8]", off
    assert off["build"]["refused"]["bf16"].startswith("refused by shadow on live traffic"), off["build"]
    good = _build(switched, "good")["shadow"]
    assert good["state"] == "passed" and good["rows_compared"] >= ROWS, good
    print(format_status(refused, notes=False))
    files = sorted((tmp_path / "cache").glob(f"{verdicts.PREFIX}*{verdicts.SUFFIX}"))
    assert len(files) == 2 and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files), files
    records = [json.loads(f.read_text()) for f in files]
    assert {r["model"] for r in records} == {"off", "good"} and all("bf16" in r["refused"] or "bf16" in r["passed"]
                                                                     for r in records), records  # fmt: skip
    daemon.stop()
    # A fleet learns it too: the cache exported as a signed bundle and imported into an empty cache elsewhere.
    private, public = key_pair(tmp_path / "keys", "fleet")
    export_bundle(tmp_path / "cache", tmp_path / "fleet.bundle", None, load_signing_key(private))
    imported = import_bundle(tmp_path / "fleet.bundle", tmp_path / "fleet-cache", trusted_keys=(str(public),))
    assert len(list((tmp_path / "fleet-cache").glob(f"{verdicts.PREFIX}*{verdicts.SUFFIX}"))) == 2, imported

    again = start_daemon(config)
    _serves_what_was_proven(again)
    answer = again.control({"cmd": "fallback", "model": "off", "reset": True})
    assert answer["ok"] and answer["refusals_cleared"] == 1, answer
    remaining = [json.loads(f.read_text())["model"] for f in (tmp_path / "cache").glob(f"{verdicts.PREFIX}*")]
    assert remaining == ["good"], remaining
    again.stop()

    _serves_what_was_proven(start_daemon({**config, "cache_dir": str(tmp_path / "fleet-cache")}))
