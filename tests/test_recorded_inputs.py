"""Served inputs recorded as evidence, with real daemons: the recording is capped, 0600 and refused when another
uid owns it, others may write it, or it is torn; a profile exact on its validation rows and off on the recorded
served inputs (tests.evidence_models.OffInBf16 under bf16) is refused by the next start's gate with the recorded
row's figures and shape."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.common import recorded_inputs
from infervisor.common.cpuinfo import read_caps
from infervisor.common.profiles import cpu_refusal
from tests.audio_models import AUDIO_INPUTS
from tests.conftest import Daemon, model_entry, wait_for
from tests.crossing_models import WIDE_INPUTS
from tests.evidence_models import OFF_INPUTS, off_in_bf16

SOURCE = {"python": "tests.evidence_models:off_in_bf16"}
#: Rows of one large request: 8,000 x 8 float32 = 256,000 bytes, four of them fit a 1 MiB cap.
LARGE_ROWS = 8000


def _rows(first: float, seed: int, rows: int = 1) -> np.ndarray:
    """Rows of N(0, 1) with the first value set: bf16 is within rounding where it is at most 0, far off from 1."""
    block = np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32)
    block[:, 0] = first
    return block


def _recorded(status: dict[str, Any], model: str) -> dict[str, Any]:
    return status["models"][model]["recorded_inputs"] or {}  # type: ignore[no-any-return]


def _send_until(
    daemon: Daemon, model: str, rows: int, first: float, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Send requests to `model` until `done(its recorded_inputs)` holds; the last status."""
    seed = [0]
    with daemon.client() as client:

        def sent() -> dict[str, Any] | None:
            seed[0] += 1
            client.infer(model, {"x": _rows(first, seed[0], rows)}, timeout=30.0)
            status = daemon.status()
            return status if done(_recorded(status, model)) else None

        return wait_for(sent, 120, f"{model}'s inputs recorded", interval=0.05)  # type: ignore[no-any-return]


def test_the_recording_is_capped_private_and_refused_when_unsafe_or_torn(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A 1 MiB recording keeps the newest four 256,000-byte requests and never more; the file is 0600; at the next
    start a file chowned to another uid, one made 0666 and one truncated are each refused with the reason and not
    loaded, while the intact one is; `record_inputs: false` keeps nothing."""
    cache = tmp_path / "cache"
    entry = {"profiles": ["jit", "eager"]}
    config = {"oversubscribe": True, "cache_dir": str(cache), "models": {
        "capped": model_entry(SOURCE, OFF_INPUTS, record_inputs_mb=1, **entry),
        "owned": model_entry(SOURCE, OFF_INPUTS, **entry),
        "open": model_entry(SOURCE, OFF_INPUTS, **entry),
        "torn": model_entry(SOURCE, OFF_INPUTS, **entry),
        "private": model_entry(SOURCE, OFF_INPUTS, record_inputs=False, **entry),
    }}  # fmt: skip
    daemon = start_daemon(config)
    daemon.wait_ready(240)
    capped = _send_until(daemon, "capped", LARGE_ROWS, 0.0, lambda r: r.get("taken", 0) >= 7)
    report = _recorded(capped, "capped")
    assert report["samples"] == 4 and report["bytes"] == 4 * LARGE_ROWS * 8 * 4 <= report["cap_bytes"], report
    assert report["groups"]["8"]["samples"] == 4 and report["groups"]["8"]["seen"] >= 7, report
    for name in ("owned", "open", "torn"):
        _send_until(daemon, name, 1, 0.0, lambda r: r.get("samples", 0) >= 2)
    private = _send_until(daemon, "private", 1, 0.0, lambda r: True)
    assert private["models"]["private"]["recorded_inputs"] is None, private["models"]["private"]
    assert daemon.stop() == 0
    files = {name: recorded_inputs.of_model(cache, name) for name in ("capped", "owned", "open", "torn", "private")}
    assert all(len(found) == 1 for name, found in files.items() if name != "private") and not files["private"], files
    for (path,) in (found for found in files.values() if found):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    capped_file = files["capped"][0]
    assert os.path.getsize(capped_file) <= (1 << 20) + recorded_inputs.HEADER_SLACK, capped_file
    os.chown(files["owned"][0], 65534, 65534)
    os.chmod(files["open"][0], 0o666)
    torn = files["torn"][0]
    torn.write_bytes(torn.read_bytes()[:-10])

    again = start_daemon(config)
    again.wait_ready(240)
    refused = lambda s: all(_recorded(s, m).get("refused") for m in ("owned", "open", "torn"))  # noqa: E731
    status = wait_for(lambda: s if refused(s := again.status()) else None, 60, "three recordings refused")
    assert "owned by uid 65534" in _recorded(status, "owned")["refused"], _recorded(status, "owned")
    assert "writable by group and others" in _recorded(status, "open")["refused"], _recorded(status, "open")
    assert "damaged or truncated" in _recorded(status, "torn")["refused"], _recorded(status, "torn")
    assert all(_recorded(status, m)["samples"] == 0 for m in ("owned", "open", "torn")), status["models"]
    loaded = wait_for(lambda: s if _recorded(s := again.status(), "capped").get("samples") else None, 60, "loaded")
    assert _recorded(loaded, "capped")["samples"] == 4 and not _recorded(loaded, "capped")["refused"], loaded


@pytest.mark.skipif(cpu_refusal("bf16", read_caps()) is not None, reason="no native bf16 on this CPU")
def test_the_next_start_refuses_a_profile_off_on_the_recorded_served_inputs(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Served rows whose first value is 1.5 are recorded while jit serves; at the next start with bf16 first in the
    chain (shadow off) the gate refuses bf16 on a recorded input with its figures and shape and eager serves,
    while the same model under another name (no recording) passes bf16 on its validation rows alone."""
    validation = tmp_path / "validation.npz"
    np.savez(validation, x=np.concatenate([_rows(-0.5, seed) for seed in range(8)]))
    cache = tmp_path / "cache"
    first = {"oversubscribe": True, "cache_dir": str(cache), "models": {
        "off": model_entry(SOURCE, OFF_INPUTS, profiles=["jit", "eager"], validation=str(validation)),
    }}  # fmt: skip
    daemon = start_daemon(first)
    daemon.wait_ready(240)
    _send_until(daemon, "off", 1, 1.5, lambda r: r.get("samples", 0) >= 3)
    assert daemon.stop() == 0

    # No builder (pick first, shadow off, bf16 builds nothing): each worker's own gate decides before READY.
    lossy = {"profiles": ["bf16", "eager"], "validation": str(validation), "shadow": "off"}
    second = {"oversubscribe": True, "cache_dir": str(cache), "models": {
        "off": model_entry(SOURCE, OFF_INPUTS, **lossy),
        "unrecorded": model_entry(SOURCE, OFF_INPUTS, **lossy),
    }}  # fmt: skip
    again = start_daemon(second)
    status = again.wait_ready(240)
    off = status["models"]["off"]
    why = " ".join(s for s in off["workers"][0]["profile_skipped"] if s.startswith("bf16"))
    assert "recorded input" in why and "served as x[1, 8]" in why and "cosine" in why, off["workers"][0]
    assert off["serving"] == ["eager"], off
    assert status["models"]["unrecorded"]["serving"] == ["bf16"], status["models"]["unrecorded"]
    with again.client() as client:
        x = _rows(1.5, 99)
        (got,) = client.infer("off", {"x": x}, timeout=30.0).values()
    with torch.inference_mode():
        assert np.allclose(got, off_in_bf16()(torch.from_numpy(x)).numpy(), rtol=1e-3, atol=1e-3)


def test_the_pick_times_at_the_recorded_served_mix(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """A 1-D audio model served 16,000- and 4,000-sample requests (3 to 1) has its fastest pick timed at its declared
    example first, and at the next start at the served mix, both lengths named with their shares."""
    cache = tmp_path / "cache"
    config = {"oversubscribe": True, "cache_dir": str(cache), "models": {
        "kws": model_entry({"python": "tests.audio_models:keyword_cnn"}, AUDIO_INPUTS, profiles=["jit", "eager"],
                           pick="fastest"),
    }}  # fmt: skip
    daemon = start_daemon(config)
    first = daemon.wait_ready(240)
    assert "served mix" not in (first["models"]["kws"]["workers"][0]["timed_at"] or ""), first["models"]["kws"]
    count = [0]
    with daemon.client() as client:

        def sent() -> dict[str, Any] | None:
            count[0] += 1
            length = 4000 if count[0] % 4 == 0 else 16000
            audio = np.random.default_rng(count[0]).standard_normal((1, 1, length)).astype(np.float32)
            client.infer("kws", {"audio": audio}, timeout=30.0)
            groups = _recorded(status := daemon.status(), "kws").get("groups", {})
            return status if len(groups) == 2 and sum(g["seen"] for g in groups.values()) >= 12 else None

        wait_for(sent, 120, "both lengths recorded", interval=0.02)
    assert daemon.stop() == 0
    again = start_daemon(config)
    status = again.wait_ready(240)
    timed = status["models"]["kws"]["workers"][0]["timed_at"] or ""
    assert timed.startswith("the served mix: ") and "1x16000" in timed and "1x4000" in timed, timed
    assert "(recorded inputs)" in timed, timed


def test_a_pick_timed_at_wide_served_traffic_chooses_what_is_fastest_there(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A running-sum model whose jit (traced at its smallest width, 16) is O(width^2) where eager is O(width): its
    first fastest pick is timed at 16; after traffic at 2,048 is recorded, the next start times at the served mix and
    picks eager, with jit passed and timed, not refused."""
    cache = tmp_path / "cache"
    config = {"oversubscribe": True, "cache_dir": str(cache), "models": {
        "sum": model_entry({"python": "tests.crossing_models:running_sum"}, WIDE_INPUTS, profiles=["jit", "eager"],
                           pick="fastest", build="at_start"),
    }}  # fmt: skip
    daemon = start_daemon(config)
    first = daemon.wait_ready(240)["models"]["sum"]["workers"][0]
    assert "served mix" not in (first["timed_at"] or "") and "16" in (first["timed_at"] or ""), first
    rows = np.random.default_rng(0)
    with daemon.client() as client:

        def sent() -> bool:
            client.infer("sum", {"x": rows.standard_normal((1, 2048)).astype(np.float32)}, timeout=60.0)
            return _recorded(daemon.status(), "sum").get("samples", 0) >= 3

        wait_for(sent, 180, "wide requests recorded", interval=0.02)
    assert daemon.stop() == 0
    again = start_daemon(config).wait_ready(240)["models"]["sum"]["workers"][0]
    assert again["timed_at"].startswith("the served mix: ") and "2048" in again["timed_at"], again
    assert again["profile"] == "eager", again
    (jit,) = [note for note in again["profile_skipped"] if note.startswith("jit")]
    assert "passed" in jit and "not picked" in jit, jit
