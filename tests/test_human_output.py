"""What a person reads on screen: figures first, no raw dicts or internal clocks, long notes once, true counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import StartPhase
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.commands.build import ModelBuild, _Watch
from infervisor.supervisor.commands.demo import load_line, switch_line
from infervisor.supervisor.commands.infer import output_text, summarize, timing_text
from infervisor.supervisor.commands.status import format_status
from infervisor.supervisor.lifecycle.background_build import BuildState
from infervisor.supervisor.lifecycle.background_build import ModelBuild as BackgroundBuild
from infervisor.supervisor.toolkit.config_edit import rewrite
from infervisor.supervisor.toolkit.provenance import command_line
from infervisor.supervisor.workers.launcher import worker_environment
from infervisor.worker.runner import FailedAtSize, ModelRunner
from infervisor.worker.state_check import refuse_stateful
from tests.conftest import ROOT

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


def _served(**profiles: str) -> dict[str, Any]:
    return {"models": {name: {"serving": [profile], "workers": []} for name, profile in profiles.items()}}


def test_the_demo_says_switched_only_when_a_model_moved_to_another_profile() -> None:
    """A warm start whose builder picks what already serves: `nothing switched`; a real move names both profiles."""
    kept, moved = switch_line(_served(clf="int8_static"), _served(clf="int8_static"), 23.5)
    assert not moved and "switched to" not in kept and "nothing switched" in kept and "clf int8_static" in kept, kept
    line, moved = switch_line(_served(clf="eager"), _served(clf="int8_static"), 80.0)
    assert moved and line.startswith("switched to the builder's pick after 80.0 s: clf eager -> int8_static"), line


def test_the_builder_line_guesses_no_time_left() -> None:
    """A build with one of three profiles decided says so and how long it ran, never `s left` (off six-fold)."""
    build = BackgroundBuild("clf", state=BuildState.BUILDING, started_at=100.0, phase="building",
                            profile="int8_static", index=2, count=3, phase_at=110.0)  # fmt: skip
    build.outcomes["eager"] = (StartPhase.PASSED.value, "")
    line = build.line(150.0)
    assert line == "optimizing: building int8_static (2 of 3), 50 s, 1 of 3 profiles decided", line
    assert "left" not in line and "estimate_s" not in build.report(150.0)


def test_repeat_lines_run_as_printed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The console script that ran is named by its absolute path (no PATH needed); run outside it, this Python's -m."""
    script = tmp_path / "bin" / "infervisor"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom infervisor.supervisor.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["bin/infervisor", "--version"])
    line = command_line()
    assert f" {script} --version" in line and not line.split("&& ")[-1].startswith("infervisor"), line
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    for argv0 in ("bin/infervisor", "/somewhere/pytest"):
        monkeypatch.setattr(sys, "argv", [argv0, "--version"])
        ran = subprocess.run(command_line(), shell=True, env=env, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0 and ran.stdout.startswith("infervisor "), (command_line(), ran.stderr)


def test_serve_says_config_errors_as_plain_lines_on_stderr(tmp_path: Path) -> None:
    """A refused config: one plain line per problem on stderr, and stdout stays JSON lines only."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"models": {"m": {"source": {"builtin": "tiny"}, "workers": "two"}}}))
    ran = subprocess.run(
        [sys.executable, "-m", "infervisor", "serve", "--config", str(config), "--runtime-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == 78, ran
    plain = ran.stderr.strip().splitlines()
    assert plain and all(line.startswith(f"infervisor serve: {config}: ") for line in plain), ran.stderr
    assert not any(line.startswith("{") for line in plain), ran.stderr
    events = [json.loads(line) for line in ran.stdout.splitlines()]
    (refused,) = [e for e in events if e["event"] == "config_invalid"]
    assert [f"infervisor serve: {config}: {p}" for p in refused["problems"]] == plain


@pytest.mark.daemon  # a real NNCF quantization: importing nncf and openvino alone takes seconds (not the fast tier)
def test_no_progress_bar_reaches_the_log_stream(capfd: pytest.CaptureFixture[str]) -> None:
    """NNCF's int8 quantization draws no progress bar on the console; workers run with tqdm's bars off."""
    ov = pytest.importorskip("openvino")
    from infervisor.worker.profiles.openvino import _quantized

    assert worker_environment(1, Path("/nonexistent"))["TQDM_DISABLE"] == "1"
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    calibration = [(torch.randn(1, 16),) for _ in range(4)]
    with torch.no_grad():
        model = ov.convert_model(module, example_input=calibration[0])
    capfd.readouterr()
    _quantized(model, calibration)
    printed = capfd.readouterr()
    for line in (printed.out + printed.err).splitlines():
        assert line.startswith("{") and json.loads(line), f"not a JSON log line: {line!r}"


class _NeedsWideInput(torch.nn.Module):
    """A stateless model that fails on any input narrower than 32 columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 32, -1).sum(-1)


def test_a_stateless_model_failing_its_first_call_is_not_blamed_on_the_state_check() -> None:
    """The load error names the first call the daemon made, not a state check the model never reached."""
    runner = ModelRunner(_NeedsWideInput(), [TensorSpec("x", "float32", (None, 16))], None)
    with pytest.raises(FailedAtSize) as info:
        refuse_stateful(runner)
    text = str(info.value)
    assert text.startswith("the model failed on its first call") and "state" not in text, text


HAND_WRITTEN = """{
  "log_level": "info",
  "models": {
    "other": {"source": {"builtin": "tiny"}, "workers": 1},
    "clf": {
      "source": {"builtin": "resnet50"},
      "inputs": [{"name": "image", "dtype": "float32", "shape": [null, 3, 224, 224]}],
      "workers": 2,   "profiles": ["int8_static", "eager"],
      "pick": "fastest"
    }
  }
}
"""


def test_optimize_writes_only_the_changed_keys_and_keeps_the_authors_layout() -> None:
    """Changed values replaced in place, a new key on a line of its own, every other line as written; the diff
    shows the changed keys and nothing else."""
    changes = {"profiles": ["jit", "eager"], "pick": "first", "workers": 2, "cores_per_worker": 1}
    new, diff = rewrite(HAND_WRITTEN, "clf", changes)
    assert json.loads(new)["models"]["clf"] == {**json.loads(HAND_WRITTEN)["models"]["clf"], **changes}
    assert new.replace('"cores_per_worker": 1,\n      ', "").replace('["jit", "eager"]', '["int8_static", "eager"]') \
        .replace('"pick": "first"', '"pick": "fastest"') == HAND_WRITTEN, new  # fmt: skip
    shown = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("---", "+++"))]
    assert shown == [
        '+      "cores_per_worker": 1,',
        '-      "workers": 2,   "profiles": ["int8_static", "eager"],',
        '-      "pick": "fastest"',
        '+      "workers": 2,   "profiles": ["jit", "eager"],',
        '+      "pick": "first"',
    ], diff
    assert rewrite(new, "clf", changes) == (new, "")


@pytest.mark.parametrize("stamp", ["", "all\n", "serve\n"])
def test_dev_demo_installs_nothing_over_a_venv_that_holds_the_serving_set(tmp_path: Path, stamp: str) -> None:
    """`./dev setup serve` (what `./dev demo` runs first) is a no-op on a venv stamped serve or all (an empty stamp is
    the old ./dev's, which installed every extra); an unknown set is a usage error."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text(stamp)
    env = {"PATH": "/usr/bin:/bin", "VENV": str(venv), "PYTHON": "/nonexistent/python"}
    done = subprocess.run([str(ROOT / "dev"), "setup", "serve"], capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done
    wrong = subprocess.run([str(ROOT / "dev"), "setup", "dev"], capture_output=True, text=True, env=env, timeout=60)
    assert wrong.returncode == 2 and "usage: ./dev" in wrong.stderr, wrong
