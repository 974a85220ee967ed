"""The sequence gate: a stateful model's profiles checked against eager over whole sequences, state fed back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import ROOT, Daemon, model_entry, wait_for
from tests.sequence_models import STATE, STATE_INPUTS, small_gru

#: Steps the validation sequences of the GRU are cut to (the file holds more).
GRU_STEPS = 40


def test_a_profile_whose_state_drifts_is_refused_at_its_step_and_an_exact_one_serves_on_validation_sequences(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Through real workers: jit of a model whose traced graph nudges its state each step passes the single-call
    gate but is refused by the sequence gate with the step that crossed, so eager serves; jit of a GRU, checked
    on the validation file's sequences (cut to sequence_steps), serves a stream with that verdict in status."""
    sequences = tmp_path / "sequences.npz"
    np.savez(sequences, **{"seq:x": np.random.default_rng(7).standard_normal((60, 3, 8)).astype(np.float32)})
    stateful = {"outputs": ["y", "h_out"], "state": STATE, "profiles": ["jit", "eager"]}
    config = {
        "oversubscribe": True,
        "models": {
            "drift": model_entry({"python": "tests.sequence_models:drifts_when_traced"}, STATE_INPUTS, **stateful),
            "gru": model_entry({"python": "tests.sequence_models:small_gru"}, STATE_INPUTS, **stateful,
                               validation=str(sequences), sequence_steps=GRU_STEPS),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(300)
    (drift,) = status["models"]["drift"]["workers"]
    assert drift["profile"] == "eager", drift
    (refusal,) = [r for r in drift["profile_skipped"] if r.startswith("jit: ")]
    # Refused by the sequence gate alone: the single-call gate's refusals read "worst-row cosine ... on ...".
    found = re.search(
        r"over 200-step sequences \(4 synthetic streams, each feeding back its own state\) its (output 'y'|state "
        r"'h_out') drifted from eager: cosine (0\.\d+) < 0\.999 at step (\d+) \(stream \d; step 1: cosine (0\.\d+|1)",
        refusal,
    )
    assert found is not None, refusal
    crossed, step, first = float(found.group(2)), int(found.group(3)), float(found.group(4))
    assert 1 < step <= 200 and crossed < 0.999 < first, refusal
    (gru,) = status["models"]["gru"]["workers"]
    assert gru["profile"] == "jit" and gru["checked_on"] == "validation set", gru
    verdict = gru["sequence_check"]
    assert verdict is not None, gru
    assert verdict.startswith(f"over 3 validation streams x {GRU_STEPS} steps, each feeding back"), verdict
    assert "every step within the tolerance: worst cosine" in verdict and " at step " in verdict, verdict
    assert drift["sequence_check"] is None, drift  # eager is the reference: nothing to walk
    module, h = small_gru(), torch.zeros(1, 16)
    with daemon.client() as client, client.stream("gru", return_state=True) as stream:
        for step in range(3):  # jit serves the stream: each step within the tolerance of eager's, state and all
            x = np.full((1, 8), 0.1 * step, np.float32)
            got = stream.infer({"x": x})["y"]
            with torch.no_grad():
                want, h = module(torch.from_numpy(x), h)
            np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
            np.testing.assert_allclose(stream.state["h_out"], h.numpy(), atol=1e-5)

        def one_step_audited() -> dict[str, Any] | None:  # the live audit reruns a step on its committed state
            stream.infer({"x": np.zeros((1, 8), np.float32)})
            audit: dict[str, Any] = daemon.status()["models"]["gru"]["audit"]
            return audit if audit["rows_audited"] else None

        audit = wait_for(one_step_audited, 120, "a step of the stream audited", interval=0.2)
    assert audit["rows_below_tolerance"] == 0 and audit["worst"]["input_shape"] == "x[1, 8], h[1, 16]", audit


def _validation_problems(tmp_path: Path, arrays: dict[str, np.ndarray], state: bool = True) -> list[str]:
    """The config's problems at models.m.validation when the file holds `arrays` (the stateful entry, or without
    its `state` key)."""
    np.savez(tmp_path / "v.npz", **arrays)
    entry = {"source": {"builtin": "resnet50"}, "inputs": STATE_INPUTS, "outputs": ["y", "h_out"],
             "validation": "v.npz", **({"state": STATE} if state else {})}  # fmt: skip
    try:
        parse_config(json.dumps({"models": {"m": entry}}), tmp_path)
    except ConfigError as exc:
        return [p for p in exc.problems if p.startswith("models.m.validation")]
    return []


def test_the_config_checks_a_validation_file_of_sequences(tmp_path: Path) -> None:
    """Sequences alone, or besides samples, are accepted for a stateful model; a wrong shape, a state input's
    sequence, steps that differ between inputs, or sequences for a model without state are refused by name."""
    x = np.zeros((10, 2, 8), np.float32)
    samples = {"x": np.zeros((3, 8), np.float32), "h": np.zeros((3, 16), np.float32)}
    assert _validation_problems(tmp_path, {"seq:x": x}) == []
    assert _validation_problems(tmp_path, {"seq:x": x, **samples}) == []
    (wrong,) = _validation_problems(tmp_path, {"seq:x": np.zeros((10, 2, 9), np.float32)})
    assert "sequences: array 'seq:x' is float32[10, 2, 9]; expected [steps, streams, ...] of x float32" in wrong
    (carried,) = _validation_problems(tmp_path, {"seq:x": x, "seq:h": np.zeros((10, 2, 16), np.float32)})
    assert "'seq:h' is a state input: every sequence starts from the declared initial state" in carried
    (stateless,) = _validation_problems(tmp_path, {"seq:x": x, **samples}, state=False)
    assert "holds sequences ('seq:x') but the model declares no `state`" in stateless
    two = {"seq:x@a": x, "seq:x@b": np.zeros((5, 1, 8), np.float32)}
    assert _validation_problems(tmp_path, two) == []  # each group its own streams and steps


def test_bench_measures_a_stateful_model_whose_validation_file_holds_only_sequences(tmp_path: Path) -> None:
    """`infervisor bench` reads the file as a worker does: the sequences' steps are its samples, not a missing key."""
    sequences = tmp_path / "sequences.npz"
    np.savez(sequences, **{"seq:x": np.random.default_rng(7).standard_normal((20, 2, 8)).astype(np.float32)})
    entry = model_entry({"python": "tests.sequence_models:small_gru"}, STATE_INPUTS, outputs=["y", "h_out"],
                        state=STATE, validation=str(sequences), sequence_steps=10)  # fmt: skip
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"gru": entry}}))
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "bench", "--config", str(config), "--models", "gru", "--profiles",
         "eager,jit", "--threads", "1", "--seconds", "0.2", "--no-daemon", "--json", str(rows_file)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {row["profile"]: row for row in json.loads(rows_file.read_text())}
    assert set(rows) == {"eager", "jit"} and not any("skipped" in row for row in rows.values()), rows
    assert all(row["checked_on"] == "validation set" for row in rows.values()), rows
