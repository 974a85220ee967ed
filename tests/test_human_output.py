"""What a person reads on screen: figures first, no raw dicts or internal clocks, long notes once, true counts."""

from __future__ import annotations

from typing import Any

import numpy as np

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.commands.build import ModelBuild, _Watch
from infervisor.supervisor.commands.demo import load_line
from infervisor.supervisor.commands.infer import output_text, summarize, timing_text
from infervisor.supervisor.commands.status import format_status

BUILT = "built and checked against eager in {ms} ms: worst-row cosine 1.000000000000 over 3 synthetic samples " * 3


def _worker(slot: int, ms: int) -> dict[str, Any]:
    return {
        "slot": slot, "pid": 100 + slot, "state": "serving", "cores": [slot], "threads": 1, "profile": "jit",
        "rss": 2**28, "pss": 2**27, "requests": 5, "p50_ms": 1.0, "p99_ms": 2.0, "last_exit": None,
        "profile_build": [BUILT.format(ms=ms)], "profile_skipped": ["int8_static: not in budget"],
        "accuracy_warning": None,
    }  # fmt: skip


def _status(*workers: dict[str, Any]) -> dict[str, Any]:
    model = {"errors": {}, "queued": 0, "queue_size": 64, "completed": 10, "p50_ms": 1.0, "p99_ms": 2.0,
             "workers": list(workers)}  # fmt: skip
    return {"config": {"digest": "abc"}, "pid": 1, "state": "ready", "uptime_s": 3.0, "rss": 2**25,
            "endpoints": {"client": "ipc:///x/infer.sock"}, "models": {"clf": model}}  # fmt: skip


def test_notes_that_differ_only_by_build_time_are_printed_once_and_wrapped() -> None:
    """Two workers that built the same chain: one block of notes under the table, no line over 120 characters."""
    text = format_status(_status(_worker(0, 695), _worker(1, 519)))
    assert text.count("built and checked against eager in 695 ms") == 1 and "519 ms" not in text, text
    assert "every worker (times of slot 0):" in text and text.count("int8_static: not in budget") == 1
    assert max(len(line) for line in text.splitlines()) <= 120, text
    assert "built:" not in format_status(_status(_worker(0, 695)), notes=False)


def test_workers_with_different_notes_each_keep_their_own() -> None:
    """A worker that skipped something else is not merged with the others."""
    other = {**_worker(1, 519), "profile_skipped": ["jit: crashed its worker"]}
    text = format_status(_status(_worker(0, 695), other))
    assert "slot 0:" in text and "slot 1:" in text and "jit: crashed its worker" in text


def test_timing_and_outputs_read_as_text_without_dicts_or_clocks() -> None:
    """The server's stage times in ms without its clock reading; an output as shape, range and top-5 classes."""
    timing = {"queue_ms": 0.04, "dispatch_ms": 0.2, "decode_ms": 0.1, "model_ms": 1.234, "encode_ms": 0.05,
              "total_ms": 1.5, "accepted_clock_ms": 946799.851}  # fmt: skip
    text = timing_text(timing)
    assert text.startswith("model 1.23 ms, total 1.50 ms") and "946799" not in text and "clock" not in text
    logits = output_text(summarize("logits", np.arange(10, dtype=np.float32).reshape(1, 10)))
    assert "{" not in logits and "[[" not in logits, logits
    assert logits.startswith("logits: float32 [1, 10], min 0 max 9") and "top-5 classes of row 0 9 (9)" in logits


def test_the_load_line_leads_with_req_per_s_p50_p99() -> None:
    """req/s, p50 and p99 come first; how they were made follows in brackets."""
    line = load_line("clf", [1.0, 2.0, 3.0, 4.0], [], 2, 2.0)
    assert line.startswith("clf: 2.0 req/s, p50 ") and " p99 " in line.split("(")[0], line


def test_build_progress_counts_packages_not_the_profiles_place_in_the_chain() -> None:
    """int8_static third in a chain of four, first of two packages: `package 1 of 2`, never `3 of 4`."""
    said: list[str] = []
    watch = _Watch(ModelBuild("clf"), said.append, ["int8_static", "aoti"])
    watch.on(wm.Progress(phase="building", profile="int8_static", index=3, count=4, elapsed_ms=0.0, detail=""))
    watch.on(wm.Progress(phase="building", profile="jit", index=1, count=4, elapsed_ms=0.0, detail=""))
    assert "int8_static (package 1 of 2): building" in said[0] and "3 of 4" not in said[0], said
    assert said[1].endswith("jit: building"), said
