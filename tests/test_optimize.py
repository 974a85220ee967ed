"""`infervisor optimize`'s layout sweep: which layouts fit, how the choice is made, and the check through a daemon."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from infervisor.common import recorded_inputs
from infervisor.supervisor.commands.optimize import format_report
from infervisor.supervisor.host.topology import LogicalCpu, Topology
from infervisor.supervisor.settings.config import Config, parse_config
from infervisor.supervisor.toolkit.constraints import Accuracy, Data, InputShape, Sla
from infervisor.supervisor.toolkit.layouts import Layout, layouts, placement
from infervisor.supervisor.toolkit.optimize import chain_at, choose, noise_notes
from infervisor.supervisor.toolkit.served_sizes import served_sizes, warning
from infervisor.supervisor.toolkit.sweep import Figures, Point, contradiction
from tests.audio_models import AUDIO_INPUTS
from tests.conftest import ROOT, TINY_INPUTS, Daemon

INF = float("inf")
BUDGET = Accuracy(0.99, None, False)


def _topology(cores: int, smt: bool = False) -> Topology:
    """One NUMA node of `cores` physical cores; with SMT, cpu c and c + cores are siblings."""
    cpus = []
    for core in range(cores):
        siblings = (core, core + cores) if smt else (core,)
        cpus += [LogicalCpu(cpu, 0, core, 0, siblings) for cpu in siblings]
    return Topology(tuple(sorted(cpus, key=lambda c: c.cpu)))


def _config(**other: int) -> Config:
    """A config with model `m` and, when given, a model `a` of `workers` x `cores_per_worker` placed before it."""
    entry = {"source": {"builtin": "tiny"}, "inputs": TINY_INPUTS}
    models = {"a": {**entry, **other}} if other else {}
    return parse_config(json.dumps({"models": {**models, "m": entry}}), Path("."))


def test_layouts_are_every_workers_x_cores_that_fits_beside_the_other_models() -> None:
    """4 cores: 1-4 one-core workers, 1-2 two-core ones, one of 3 or 4; a 1-core neighbour takes one core away."""
    four = _topology(4)
    assert [str(x) for x in layouts(_config(), "m", four, range(4))] == [
        "1x1", "2x1", "3x1", "4x1", "1x2", "2x2", "1x3", "1x4",
    ]  # fmt: skip
    beside = layouts(_config(workers=1, cores_per_worker=1), "m", four, range(4))
    assert [str(x) for x in beside] == ["1x1", "2x1", "3x1", "1x2", "1x3"]
    assert placement(_config(workers=1, cores_per_worker=1), "m", Layout(1, 2), four, range(4)) == [(1, 2)]
    # The cpuset decides, not the machine: two allowed cpus of four.
    assert [str(x) for x in layouts(_config(), "m", four, [2, 3])] == ["1x1", "2x1", "1x2"]
    assert [str(x) for x in layouts(_config(), "m", four, range(4), cores=[2])] == ["1x2", "2x2"]


def test_layouts_count_physical_cores_not_smt_siblings() -> None:
    """2 cores with SMT siblings: the same three layouts as without (a worker gets whole cores)."""
    assert [str(x) for x in layouts(_config(), "m", _topology(2, smt=True), range(4))] == ["1x1", "2x1", "1x2"]
    with pytest.raises(ValueError, match="at least one worker"):
        Layout.parse("0x2")
    assert Layout.parse("2X1") == Layout(2, 1)


def _point(profile: str, layout: str, p99: float, qps: float) -> Point:
    return Point(profile, Layout.parse(layout), p99 * 0.9, p99, qps, p99 * 1.2)


def _rows(**cosines: float) -> dict[str, dict[str, object]]:
    return {
        name: {"profile": name, "p50_ms": 1.0, "cosine": cosine, "max_abs_error": 0.0, "cold_start_s": 1.0}
        for name, cosine in cosines.items()
    }


#: The measured trade of the issue: eager resnet18 on a 2-core box.
RESNET18 = [_point("eager", "2x1", 50.0, 39.0), _point("eager", "1x2", 33.0, 32.0), _point("eager", "1x1", 50.0, 20.0)]


def test_the_p99_bound_decides_first_then_throughput() -> None:
    """Without a P99 bound two 1-core workers win on QPS; with 40 ms one 2-core worker does."""
    rows = _rows(eager=1.0)
    free, verdict = choose(RESNET18, rows, Sla(INF, INF, 0.0, 0.0, BUDGET), BUDGET)
    assert free is not None and str(free.layout) == "2x1" and verdict.met and verdict.layout == "2x1"
    bound, verdict = choose(RESNET18, rows, Sla(INF, 40.0, 0.0, 0.0, BUDGET), BUDGET)
    assert bound is not None and str(bound.layout) == "1x2" and verdict.met


def test_a_missed_sla_names_each_profiles_best_layout_and_still_chooses_the_best_effort() -> None:
    """P99 40 ms and 35 QPS: nothing meets both; 1x2 (within the bound) is the best effort, and the reason says why."""
    chosen, verdict = choose(RESNET18, _rows(eager=1.0), Sla(INF, 40.0, 35.0, 0.0, BUDGET), BUDGET)
    assert chosen is not None and str(chosen.layout) == "1x2"
    assert not verdict.met and verdict.reasons == ["eager (best at 1x2): 32.0 QPS with 1x2 < 35"]


def test_a_profile_outside_the_accuracy_budget_is_never_chosen_nor_chained() -> None:
    """int8 twice as fast but below the budget's cosine: eager serves and int8 is not in the chain."""
    points = [*RESNET18, _point("int8_static", "2x1", 12.0, 160.0), _point("jit", "2x1", 40.0, 45.0)]
    rows = _rows(eager=1.0, int8_static=0.95, jit=1.0)
    chosen, _ = choose(points, rows, Sla(INF, INF, 0.0, 0.0, BUDGET), BUDGET)
    assert chosen is not None and (chosen.profile, str(chosen.layout)) == ("jit", "2x1")
    assert chain_at(points, rows, BUDGET, chosen) == ["jit", "eager"]


def test_a_figure_the_cores_cannot_explain_is_flagged_and_never_chosen() -> None:
    """The issue's eager 1x1 = 1,184 QPS and 2x1 = 7,158 (x6 with 2 workers), and a busy P99 below the idle one, are
    contradictions; 2x1 at 2,200 QPS is not. A point still suspect after its re-measure is never chosen, even as the
    fastest."""
    idle = Figures(1184.0, 0.8, 2.0, 0.05, 0.1)
    assert "x6.0 one worker's" in (contradiction(idle, Figures(7158.0, 0.2, 2.5, 0.05, 0.1), 2) or "")
    assert "below the idle" in (contradiction(idle, Figures(2200.0, 0.8, 1.2, 0.05, 0.1), 2) or "")
    assert contradiction(idle, Figures(2200.0, 0.9, 2.4, 0.05, 0.1), 2) is None
    suspect = Point("eager", Layout(2, 1), 0.8, 2.0, 7158.0, 2.5, suspect="x6.0")
    chosen, verdict = choose([suspect, _point("eager", "1x1", 2.0, 1184.0)], _rows(eager=1.0),
                             Sla(INF, INF, 0.0, 0.0, BUDGET), BUDGET)  # fmt: skip
    assert chosen is not None and str(chosen.layout) == "1x1" and verdict.layout == "1x1"


def test_one_chosen_leads_the_chain_and_is_the_one_the_table_marks() -> None:
    """eager 2x1 chosen over a slower jit_onednn: the chain is eager alone (the issue's table marked eager while the
    chain written and checked led with jit_onednn), and the table marks exactly that point."""
    points = [_point("eager", "2x1", 10.0, 300.0), _point("jit_onednn", "2x1", 12.0, 200.0)]
    rows = _rows(eager=1.0, jit_onednn=1.0)
    chosen, verdict = choose(points, rows, Sla(INF, INF, 0.0, 0.0, BUDGET), BUDGET)
    assert chosen is not None and chain_at(points, rows, BUDGET, chosen) == ["eager"]
    shown = [{**row, "rss_mb": 100.0, "risk": ""} for row in rows.values()]
    table = format_report(shown, points, BUDGET, chosen, verdict)
    (marked,) = [line for line in table.splitlines() if "<- chosen" in line]
    assert marked.split()[:2] == ["2x1", "eager"]


def test_points_within_each_others_noise_give_the_same_choice_whichever_reads_higher() -> None:
    """1x1 and 2x1 5% apart (within the noise) choose the same point in either order, and the output names the
    rival; a noisy 372 QPS does not tie a 217 (their ranges do not meet); a P99 within its spread of the bound is said
    to be within the noise, with what would decide it."""
    sla = Sla(INF, 40.0, 0.0, 0.0, BUDGET)
    for one, two in ((100.0, 105.0), (105.0, 100.0)):
        points = [_point("eager", "1x1", 30.0, one), _point("eager", "2x1", 30.0, two)]
        chosen, _ = choose(points, _rows(eager=1.0), sla, BUDGET)
        assert chosen is not None and str(chosen.layout) == "2x1"
        notes = noise_notes(points, chosen, sla, 2.0)
        assert any(note.startswith("eager 1x1") for note in notes) and not any("bound" in n for n in notes)
    noisy = Point("jit_onednn", Layout(1, 1), 0.7, 21.0, 372.6, 21.0, qps_spread=0.42)
    steady = Point("eager", Layout(2, 1), 1.3, 30.0, 217.0, 57.6, qps_spread=0.16)
    chosen, _ = choose([steady, noisy], _rows(eager=1.0, jit_onednn=1.0), sla, BUDGET)
    assert chosen == noisy and noise_notes([steady, noisy], noisy, sla, 2.0) == ()
    close = Point("eager", Layout(1, 1), 30.0, 38.0, 100.0, 38.0, p99_spread=0.2)
    notes = noise_notes([close], close, sla, 2.0)
    assert notes[0].startswith("in process: P99 38.00 ms (spread 20%) is within the noise of the 40 ms bound")
    assert notes[-1].startswith("in process: to decide: measure longer (--seconds 4")


def test_the_sizes_measured_at_are_the_served_ones_never_silently_the_minimum() -> None:
    """1,000-32,000 samples declared in the constraints: 5 sizes at the range's quantiles; else typical_shape; else
    the declared minimum, with a warning."""
    specs = parse_config(json.dumps({"models": {"kws": {"source": {"builtin": "tiny"}, "inputs": AUDIO_INPUTS}}}),
                         Path(".")).models["kws"].inputs  # fmt: skip
    data = Data((InputShape("audio", (1, 1, (1000, 32000))),), 1, None)
    sizes = served_sizes(specs, data, {"audio": [1, 1, 16000]})
    assert [s["audio"] for s in sizes.shapes] == [(1, 1, n) for n in (4100, 10300, 16500, 22700, 28900)]
    assert sizes.text == "1x4100 .. 1x28900 (5 sizes spread over constraints data.inputs)" and not warning(sizes)
    typical = served_sizes(specs, None, {"audio": [1, 1, 16000]})
    assert typical.text == "1x16000 (typical_shape)" and not warning(typical)
    least = served_sizes(specs, None, None)
    assert least.shapes == ({"audio": (1, 1, 1000)},) and warning(least)[0].startswith("WARNING: measured at 1x1000")


def _optimize(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infervisor", "optimize", *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False,
    )  # fmt: skip


def test_optimize_sweeps_the_layouts_checks_the_choice_through_a_daemon_and_writes_both(
    tmp_path: Path, start_daemon: Callable[..., Daemon]
) -> None:
    """tiny on this box: a point per layout, a daemon check under probe's load, workers and cores written; the
    probe command it prints runs against a daemon serving the written config."""
    config = tmp_path / "config.json"
    entry = {"source": {"builtin": "tiny"}, "inputs": TINY_INPUTS, "workers": 1, "cores_per_worker": 1}
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"tiny": entry}}, indent=2))
    report = tmp_path / "report.json"
    done = _optimize("--model", "tiny", "--config", str(config), "--profiles", "eager", "--layouts", "1x1,2x1",
                     "--seconds", "0.3", "--check-seconds", "2", "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert [(p["layout"], p["profile"]) for p in result["layouts"]] == [("1x1", "eager"), ("2x1", "eager")]
    assert all(p["qps"] > 0 and p["busy_p99_ms"] > 0 for p in result["layouts"])
    chosen = result["layout"]
    check = result["check"]
    assert check["profiles"] == ["eager"] * chosen["workers"] and check["errors"] == 0
    assert check["p99_ms"] >= check["p50_ms"] > 0 and check["samples"] > 0
    written = parse_config(config.read_text(), tmp_path).models["tiny"]
    assert (written.workers, written.cores_per_worker) == (chosen["workers"], chosen["cores_per_worker"])
    (command,) = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if "infervisor probe" in line]
    argv = shlex.split(command)
    assert argv[:4] == ["infervisor", "probe", "--model", "tiny"] and float(argv[5]) == check["qps"]
    daemon = start_daemon(json.loads(config.read_text()))
    daemon.wait_ready()
    probed = subprocess.run(
        [sys.executable, "-m", "infervisor", *argv[1:], "--runtime-dir", str(daemon.runtime_dir),
         "--profile-requests", "5", "--json", str(tmp_path / "probe.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=180, check=False,
    )  # fmt: skip
    assert probed.returncode == 0, probed.stdout + probed.stderr
    assert json.loads((tmp_path / "probe.json").read_text())["samples"] > 0


def _recording_of_kws(cache: Path, lengths: dict[int, int]) -> None:
    """A recording of model `kws` in `cache` as the daemon writes it: one sample per length, each seen so often."""
    recording = recorded_inputs.Recording("kws", "0" * 32)
    for length, seen in lengths.items():
        data = np.zeros((1, 1, length), np.float32).tobytes()
        tensor = recorded_inputs.RecordedTensor("audio", "float32", (1, 1, length), data)
        group = recorded_inputs.group_of([("audio", (1, 1, length))])
        recording.samples.append(recorded_inputs.RecordedSample(group, 0.0, (tensor,)))
        recording.seen[group] = seen
    cache.mkdir(mode=0o700, exist_ok=True)
    recorded_inputs.write(recorded_inputs.path_for(cache, recording.key, "kws"), recorded_inputs.encode(recording))


def test_optimize_measures_at_the_served_mix_the_daemon_recorded(tmp_path: Path) -> None:
    """With neither data.inputs nor typical_shape, the sweep and the daemon check measure at the mix the daemon
    recorded in the config's cache (16,000 samples 80%, 8,000 20%), and say so, not at the declared 1,000."""
    cache = tmp_path / "cache"
    _recording_of_kws(cache, {16000: 8, 8000: 2})
    config = tmp_path / "config.json"
    entry = {"source": {"python": "tests.audio_models:keyword_cnn"}, "inputs": AUDIO_INPUTS, "workers": 1,
             "cores_per_worker": 1}  # fmt: skip
    config.write_text(json.dumps({"cache_dir": str(cache), "models": {"kws": entry}}))
    report = tmp_path / "report.json"
    done = _optimize("--model", "kws", "--config", str(config), "--profiles", "eager", "--layouts", "1x1",
                     "--seconds", "0.3", "--check-seconds", "1", "--timeout", "120", "--dry-run",
                     "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(report.read_text())
    served = [{"audio": [1, 1, n]} for n in (16000, 16000, 16000, 16000, 8000)]
    assert result["sizes"] == served and result["check"]["inputs"] == served, result["sizes"]
    assert "the served mix recorded by the daemon: 1x16000 80%, 1x8000 20%" in done.stdout, done.stdout
    assert "WARNING: measured at" not in done.stdout


def test_a_recording_the_model_no_longer_takes_is_not_measured_at() -> None:
    """A recorded size outside the model's declared range (the spec changed since) is left out; none left: the
    declared example, with its warning."""
    specs = parse_config(json.dumps({"models": {"kws": {"source": {"builtin": "tiny"}, "inputs": AUDIO_INPUTS}}}),
                         Path(".")).models["kws"].inputs  # fmt: skip
    recording = recorded_inputs.Recording("kws", "0" * 32)
    for length in (16000, 64000):
        tensor = recorded_inputs.RecordedTensor("audio", "float32", (1, 1, length), b"")
        group = recorded_inputs.group_of([("audio", (1, 1, length))])
        recording.samples.append(recorded_inputs.RecordedSample(group, 0.0, (tensor,)))
        recording.seen[group] = 5
    sizes = served_sizes(specs, None, None, recording)
    assert sizes.shapes == ({"audio": (1, 1, 16000)},) * 5 and sizes.source.endswith("1x16000 100%"), sizes
    recording.samples.pop(0)
    fallback = served_sizes(specs, None, None, recording)
    assert fallback.minimum and warning(fallback), fallback


def test_optimize_on_a_variable_length_model_measures_at_the_declared_sizes(tmp_path: Path) -> None:
    """An audio model declared 1,000-32,000 samples in the constraints: the sweep's figures and the daemon check's
    requests are at the 5 sizes spread over that range, not at 1,000; and one answer to "what was chosen": the table's
    mark, the JSON's `chosen`, the chain's head, the check's subject and what its workers served."""
    config = tmp_path / "config.json"
    entry = {"source": {"python": "tests.audio_models:keyword_cnn"}, "inputs": AUDIO_INPUTS, "workers": 1,
             "cores_per_worker": 1}  # fmt: skip
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"kws": entry}}))
    constraints = tmp_path / "constraints.json"
    constraints.write_text(json.dumps({
        "hardware": {"memory_mb": 2048}, "operations": {},
        "sla": {"cold_start_ms": 600000, "p99_ms": 5000, "min_qps": 0, "accuracy": {"min_cosine": 0.99}},
        "data": {"inputs": [{"name": "audio", "shape": [1, 1, [1000, 32000]]}]},
    }))  # fmt: skip
    report = tmp_path / "report.json"
    done = _optimize("--model", "kws", "--config", str(config), "--constraints", str(constraints), "--profiles",
                     "eager", "--layouts", "1x1", "--seconds", "0.3", "--check-seconds", "1", "--timeout", "120",
                     "--dry-run", "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(report.read_text())
    served = [[1, 1, n] for n in (4100, 10300, 16500, 22700, 28900)]
    assert result["sizes"] == [{"audio": shape} for shape in served]
    assert result["check"]["inputs"] == [{"audio": shape} for shape in served]
    assert {p["measured_at"] for p in result["layouts"]} == {result["measured_at"]} == {result["check"]["measured_at"]}
    assert "measured at 1x4100 .. 1x28900 (5 sizes spread over constraints data.inputs)" in done.stdout
    chosen = result["chosen"]
    (marked,) = [line.split()[:2] for line in done.stdout.splitlines() if line.endswith("<- chosen")]
    assert marked == [chosen["layout"], chosen["profile"]] and result["chain"][0] == chosen["profile"]
    assert set(result["check"]["profiles"]) == {chosen["profile"]}
    assert f"CHECK of the chosen {chosen['profile']} on {chosen['layout']}" in done.stdout
