"""The gate sees one element of a long row and each group of columns of a flat row on its own scale: a frame an octave
off and a packed head's scores moved by 0.15 are refused naming the measure, element or columns and figures, while
good profiles still pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infervisor.worker.audit_loop import rows_below
from infervisor.worker.profiles.parts import column_groups, column_scales, judge_parts
from infervisor.worker.profiles.validate import Tolerance, compare
from tests.conftest import TINY_INPUTS, Daemon, model_entry, wait_for
from tests.element_models import (
    FEATURES,
    FRAMES,
    OCTAVE_FRAME,
    PACKED_INPUTS,
    PITCH_INPUTS,
    flat_scores_off_when_traced,
    octave_off_when_traced,
)


def _pitch_rows() -> tuple[np.ndarray, np.ndarray]:
    """Eager's f0 for 3 clips, and the same with one frame of clip 1 an octave up."""
    frames = torch.randn(3, FRAMES, FEATURES, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = octave_off_when_traced()(frames).numpy()
    off = want.copy()
    off[1, OCTAVE_FRAME] *= 2.0
    return want, off


def test_one_frame_an_octave_off_fails_the_element_measure_in_the_gate_and_the_audit() -> None:
    """The row's cosine stays above 0.999; the element error names the output, the element, the row and both values,
    and the audit counts that row alone; bf16-sized noise on every frame passes."""
    want, off = _pitch_rows()
    agreement = compare([want], [off], ["f0"])
    assert agreement.cosine > 0.999, agreement.cosine
    failure = agreement.failure(Tolerance())
    assert failure is not None and failure.startswith("element error "), failure
    assert f"on output 'f0', element [{OCTAVE_FRAME}] of {FRAMES} per row: eager " in failure, failure
    assert failure.endswith("> 0.1, row 1"), failure
    assert rows_below(agreement, Tolerance()) == 1
    noisy = want * (1.0 + np.random.default_rng(0).uniform(-0.004, 0.004, want.shape))
    assert compare([want], [noisy], ["f0"]).failure(Tolerance()) is None
    assert compare([want], [off], ["f0"]).failure(Tolerance(max_element_error=None)) is None  # null: off
    assert Tolerance(0.98).max_element_error == 0.4472  # loosened with the cosine, like the channel error


def test_column_groups_split_pixels_from_scores_and_never_near_zero_logits() -> None:
    """A packed row's coordinates and scores fall in two groups and moved scores fail naming the columns; logits with
    one near zero on every sample stay one group, so a good profile's small absolute error there passes."""
    image = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = flat_scores_off_when_traced()(image).numpy()
    groups = column_groups(column_scales([[want]], ["pred"])[("pred", 16)])
    assert [list(g) for g in groups] == [list(range(4, 16)), list(range(4))]
    moved = want.copy()
    moved[:, 4:] += 0.15
    (worst,) = judge_parts([want], [moved], ["pred"], {}, 0.1, column_scales([[want]], ["pred"]))
    assert worst.fails and worst.part.startswith("columns 4-15 of 16 (a group on its own scale), column "), worst
    logits = np.random.default_rng(3).normal(0.0, 0.1, (3, 1000))
    logits[:, 17] = 1e-6  # a class near zero on every sample
    noisy = logits + np.random.default_rng(4).normal(0.0, 1e-3, logits.shape)
    assert len(column_groups(np.abs(logits).max(axis=0))) == 1
    assert not any(e.fails for e in judge_parts([logits], [noisy], ["logits"], {}, 0.1))
    embedding = np.random.default_rng(5).uniform(0.5, 1.0, (3, 16))
    embedding[:, 3] = 1e-33  # a dead column, as MiniLM has: a group of its own, floored so its noise is no failure
    assert [list(g) for g in column_groups(np.abs(embedding).max(axis=0))] == [[3], [c for c in range(16) if c != 3]]
    assert not any(e.fails for e in judge_parts([embedding], [embedding + 1e-6], ["embedding"], {}, 0.1))


def _quiet_validation(folder: Path) -> str:
    """Four clips whose frame OCTAVE_FRAME is quiet (first feature -1): octave_off_when_loud's jit is exact on them."""
    frames = np.random.default_rng(6).standard_normal((4, FRAMES, FEATURES)).astype(np.float32)
    frames[:, OCTAVE_FRAME, 0] = -1.0
    np.savez(folder / "quiet.npz", frames=frames)
    return str(folder / "quiet.npz")


def _loud_until_fallen(daemon: Daemon) -> dict[str, Any]:
    """Send clips whose frame OCTAVE_FRAME is loud to `loud` until the audit has moved it to eager."""
    seed = 0

    def sent_and_fallen() -> dict[str, Any] | None:
        nonlocal seed
        with daemon.client() as client:
            for _ in range(5):
                seed += 1
                frames = np.random.default_rng(seed).standard_normal((1, FRAMES, FEATURES)).astype(np.float32)
                frames[:, OCTAVE_FRAME, 0] = 2.0
                client.infer("loud", {"frames": frames}, timeout=30.0)
        status = daemon.status()
        return status if (status["models"]["loud"].get("fallback") or {}).get("origin") == "audit" else None

    return wait_for(sent_and_fallen, 180, "the audit's fallback of loud", interval=0.05)  # type: ignore[no-any-return]


def _worker(status: dict[str, Any], model: str) -> dict[str, Any]:
    (worker,) = status["models"][model]["workers"]
    return worker  # type: ignore[no-any-return]


def test_the_daemon_refuses_an_octave_frame_and_moved_packed_scores_and_serves_a_good_profile(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Through real workers under the default tolerance: jit's frame an octave off and jit's scores moved by 0.15 are
    refused naming the measure, where and the figures, and eager serves the right answers; tiny's jit still serves; a
    jit exact on its validation set but an octave off on live traffic is caught by the audit's element measure."""
    config = {"oversubscribe": True, "models": {
        "loud": model_entry({"python": "tests.element_models:octave_off_when_loud"}, PITCH_INPUTS, outputs=["f0"],
                            profiles=["jit", "eager"], validation=_quiet_validation(tmp_path), audit={"budget": 0.5}),
        "pitch": model_entry({"python": "tests.element_models:octave_off_when_traced"}, PITCH_INPUTS,
                             outputs=["f0"], profiles=["jit", "eager"]),
        "packed": model_entry({"python": "tests.element_models:flat_scores_off_when_traced"}, PACKED_INPUTS,
                              outputs=["pred"], profiles=["jit", "eager"]),
        "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["jit", "eager"]),
    }}  # fmt: skip
    daemon = start_daemon(config)
    models = ["loud", "pitch", "packed", "tiny"]

    def serving() -> dict[str, Any] | None:
        status = daemon.try_status()
        ready = status is not None and all(_worker(status, m)["state"] == "serving" for m in models)
        return status if ready else None

    status = wait_for(serving, 300, f"{models} serving")
    pitch, packed, tiny = (_worker(status, m) for m in ("pitch", "packed", "tiny"))
    assert (pitch["profile"], packed["profile"], tiny["profile"]) == ("eager", "eager", "jit"), status
    (octave,) = pitch["profile_skipped"]
    assert octave.startswith("jit: element error "), octave
    assert f"on output 'f0', element [{OCTAVE_FRAME}] of {FRAMES} per row: eager " in octave, octave
    assert "> 0.1 on synthetic sample " in octave, octave
    (scores,) = packed["profile_skipped"]
    assert scores.startswith("jit: channel error "), scores
    assert "on output 'pred', columns 4-15 of 16 (a group on its own scale), column " in scores, scores
    frames = np.random.default_rng(5).standard_normal((1, FRAMES, FEATURES)).astype(np.float32)
    with daemon.client() as client:
        got = client.infer("pitch", {"frames": frames})["f0"]
    with torch.inference_mode():
        want = octave_off_when_traced()(torch.from_numpy(frames)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert _worker(status, "loud")["profile"] == "jit", status
    fallback = _loud_until_fallen(daemon)["models"]["loud"]["fallback"]
    assert fallback["from"] == "jit" and fallback["profiles"] == ["eager"], fallback
    assert "live audit: jit answered row 0 of a request of frames[1, 1000, 8] off eager fp32 (element error " in \
        fallback["reason"], fallback  # fmt: skip
    assert f"on output 'f0', element [{OCTAVE_FRAME}] of {FRAMES} per row" in fallback["reason"], fallback
