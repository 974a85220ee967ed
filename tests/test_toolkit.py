"""The Model-Optimizer toolkit: constraints.json validation and the doctor's checks on fake machines."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infervisor.common.cpuinfo import read_caps
from infervisor.common.profiles import cpu_refusal
from infervisor.supervisor.settings.config import Config, parse_config
from infervisor.supervisor.toolkit.constraints import ConstraintsError, load_constraints, parse_constraints
from infervisor.supervisor.toolkit.doctor import Machine, Status, run_checks
from infervisor.supervisor.toolkit.probe import STAGES, Sample, parse_perf_stat, stage_table, where_time_goes
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry
from tests.test_planner import make_sysfs

#: A profile that changes numerics and this box runs: bf16 where the CPU has it natively, else dynamic int8.
LOSSY = next(name for name in ("bf16", "int8_dynamic") if cpu_refusal(name, read_caps()) is None)

EXAMPLE = ROOT / "configs" / "constraints.example.json"
XEON = "processor\t: 0\nmodel name\t: Test Xeon\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni\n\n"
CELERON = "processor\t: 0\nmodel name\t: Test Celeron\nflags\t\t: fpu sse4_2\n\n"


def _constraints(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(EXAMPLE.read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw[section][key] = value
    return raw


def _config(workers: int = 2, profiles: tuple[str, ...] = ("eager",), **model: Any) -> Config:
    entry = {
        "source": {"builtin": "tiny"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}],
        "workers": workers,
        "profiles": list(profiles),
        **model,
    }
    return parse_config(json.dumps({"models": {"m": entry}}), ROOT)


def _machine(tmp_path: Path, cpuinfo: str = XEON, governor: str | None = None, cpu_max: str | None = None) -> Machine:
    sysfs = make_sysfs(tmp_path, 1, 2, 1)
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "cpuinfo").write_text(cpuinfo)
    (proc / "meminfo").write_text("MemTotal:  4194304 kB\nMemAvailable:  2097152 kB\n")
    (proc / "self" / "cgroup").write_text("0::/box.slice/infervisor.service\n")
    for index, (level, kind, size) in enumerate([("1", "Data", "48K"), ("2", "Unified", "1024K")]):
        folder = sysfs / f"devices/system/cpu/cpu0/cache/index{index}"
        folder.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    if governor is not None:
        for cpu in (0, 1):
            folder = sysfs / f"devices/system/cpu/cpu{cpu}/cpufreq"
            folder.mkdir(parents=True)
            (folder / "scaling_governor").write_text(governor + "\n")
            (folder / "scaling_cur_freq").write_text("2900000\n")
    if cpu_max is not None:
        folder = sysfs / "fs/cgroup/box.slice"
        folder.mkdir(parents=True)
        (folder / "cpu.max").write_text(cpu_max + "\n")
    probe = {"mkldnn": True, "openmp": True, "capability": "AVX512"}
    return Machine(sysfs=sysfs, proc=proc, allowed_cpus={0, 1}, torch_probe=lambda: probe)


def _by_name(config: Config, machine: Machine, constraints_raw: dict[str, Any] | None = None) -> dict[str, Any]:
    constraints = parse_constraints(json.dumps(constraints_raw)) if constraints_raw else None
    return {c.name: c for c in run_checks(config, constraints, machine)}


def test_the_example_constraints_parse() -> None:
    """configs/constraints.example.json is valid and carries all four rows and the accuracy budget."""
    constraints = load_constraints(EXAMPLE)
    assert constraints.hardware.memory_mb == 8192 and constraints.sla.p99_ms == 40.0
    assert constraints.sla.accuracy.min_cosine == 0.98 and constraints.sla.accuracy.top1
    assert constraints.data.inputs[0].dims == ((1, 8), 3, 224, 224)
    assert constraints.operations.restart_acceptable


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"hardware__memory_mb": 10}, "hardware.memory_mb"),
        ({"hardware__storage": "tape"}, "hardware.storage"),
        ({"sla__p99_ms": "fast"}, "sla.p99_ms"),
        ({"sla__accuracy": {"min_cosine": 2}}, "sla.accuracy.min_cosine"),
        ({"sla__accuracy": {"cosine": 0.9}}, "sla.accuracy.cosine"),
        ({"data__inputs": [{"name": "image", "shape": [[8, 1], 3]}]}, "data.inputs[0].shape[0]"),
        ({"data__typical_batch": 0}, "data.typical_batch"),
        ({"operations__restart_acceptable": "yes"}, "operations.restart_acceptable"),
        ({"hardware__colour": "blue"}, "hardware.colour"),
    ],
)
def test_a_bad_constraint_names_its_key(change: dict[str, Any], path: str) -> None:
    """Every mistake is reported with the JSON path of the key that holds it."""
    with pytest.raises(ConstraintsError) as caught:
        parse_constraints(json.dumps(_constraints(**change)))
    assert any(p.startswith(f"{path}:") for p in caught.value.problems), caught.value.problems


def test_a_missing_promise_is_required() -> None:
    """An SLA without its P99 cannot be checked against: the file is refused."""
    raw = _constraints()
    del raw["sla"]["p99_ms"]
    with pytest.raises(ConstraintsError, match=r"sla\.p99_ms: is required"):
        parse_constraints(json.dumps(raw))


def test_doctor_passes_a_well_set_machine(tmp_path: Path) -> None:
    """Performance governor, no quota, enough memory, disjoint cores: every check passes."""
    checks = _by_name(_config(), _machine(tmp_path, governor="performance"))
    assert {n: c.status for n, c in checks.items() if c.status is not Status.PASS} == {}
    assert len(checks) == 14
    assert "Test Xeon, tier avx512" in checks["instruction set"].detail
    assert "caches L1d 48K, L2 1024K" in checks["instruction set"].detail
    assert checks["CPU governor"].detail == "performance on [0, 1]; now 2900-2900 MHz"


def test_doctor_warns_and_fails_with_a_fix_each(tmp_path: Path) -> None:
    """A powersave governor and a fractional quota warn; too little memory for the target fails; each has a fix."""
    machine = _machine(tmp_path, governor="powersave", cpu_max="150000 100000")
    tight = _constraints(hardware__memory_mb=512)
    checks = _by_name(_config(workers=1, rss_hard_mb=800), machine, tight)
    assert checks["CPU governor"].status is Status.WARN and "frequency-set" not in checks["CPU governor"].fix
    assert checks["cgroup CPU limit"].status is Status.WARN and "whole number" in checks["cgroup CPU limit"].fix
    assert checks["memory headroom"].status is Status.FAIL and "512 MB" in checks["memory headroom"].detail
    assert all(c.fix for c in checks.values() if c.status is not Status.PASS)


def test_doctor_fails_a_quota_below_the_pinned_cores_and_an_impossible_plan(tmp_path: Path) -> None:
    """One CPU of quota for two pinned workers fails; three one-core workers on two cores fail the plan."""
    checks = _by_name(_config(workers=2), _machine(tmp_path, cpu_max="100000 100000"))
    assert checks["cgroup CPU limit"].status is Status.FAIL
    plan = _by_name(_config(workers=3), _machine(tmp_path / "b"))
    assert plan["threads vs cpuset"].status is Status.FAIL and plan["NUMA"].status is Status.FAIL


def test_doctor_fails_a_cpu_latency_request_the_daemon_cannot_hold(tmp_path: Path) -> None:
    """cpu_latency_us with no latency device fails with a fix; with a writable one it passes."""
    entry = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
    config = parse_config(json.dumps({"cpu_latency_us": 0, "models": {"m": entry}}), ROOT)
    machine = _machine(tmp_path)
    machine.cpu_latency_device = tmp_path / "no-such-device"
    missing = _by_name(config, machine)["CPU wake latency"]
    assert missing.status is Status.FAIL and "systemd/cpu-latency.conf" in missing.fix
    machine.cpu_latency_device = tmp_path / "cpu_dma_latency"
    machine.cpu_latency_device.write_bytes(b"")
    assert _by_name(config, machine)["CPU wake latency"].status is Status.PASS


def test_doctor_warns_about_profiles_this_cpu_will_skip(tmp_path: Path) -> None:
    """An SSE4.2-only box with a jit chain: the profiles that will be skipped are named."""
    checks = _by_name(_config(profiles=("jit", "eager")), _machine(tmp_path, cpuinfo=CELERON))
    assert checks["instruction set"].status is Status.WARN and "jit (" in checks["instruction set"].detail


def test_doctor_command_exits_non_zero_on_a_fail(tmp_path: Path) -> None:
    """`infervisor doctor` prints every check and exits 1 when one fails (here: a 256 MB target box)."""
    constraints = tmp_path / "constraints.json"
    constraints.write_text(json.dumps(_constraints(hardware__memory_mb=256)))
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "doctor", "--config", str(ROOT / "configs" / "default.json"),
         "--constraints", str(constraints), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=180, check=False,
    )  # fmt: skip
    checks = json.loads(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    assert {c["name"]: c["status"] for c in checks}["memory headroom"] == "fail"
    assert [c["name"] for c in checks][:2] == ["instruction set", "torch version"]


def _optimize(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infervisor", "optimize", *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def optimize_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the optimize runs of tiny: the lossy profile's package is compiled by the first and loaded by
    the next (their subject is the verdict and the written chain, not a second compile of the same package)."""
    return tmp_path_factory.mktemp("optimize-cache")


def _tiny_config(tmp_path: Path, cache: Path) -> Path:
    path = tmp_path / "config.json"
    entry = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
    path.write_text(json.dumps({"cache_dir": str(cache), "models": {"tiny": entry}}, indent=2) + "\n")
    return path


def test_optimize_ranks_within_the_budget_and_shows_the_chain_without_writing(
    tmp_path: Path, optimize_cache: Path
) -> None:
    """--dry-run measures each profile in its own process, ranks those in budget, and only shows the diff."""
    config = _tiny_config(tmp_path, optimize_cache)
    before = config.read_text()
    report = tmp_path / "report.json"
    done = _optimize("--model", "tiny", "--config", str(config), "--profiles", f"eager,jit,{LOSSY}", "--layouts", "1x1",
                     "--no-check", "--seconds", "0.3", "--dry-run", "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: the SLA can be met on this box" in done.stdout
    assert config.read_text() == before
    written = json.loads(report.read_text())
    assert written["written_to"] is None and written["not_written"].startswith("--dry-run: the diff was shown")
    rows = {r["profile"]: r for r in written["rows"]}
    assert set(rows) == {"eager", "jit", LOSSY}
    assert all(r["rss_mb"] > 50 and r["cold_start_s"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in rows.values())
    assert rows["eager"]["cosine"] == 1.0 and '+      "profiles": [' in done.stdout
    # The lossy profile changes numerics and tiny has no validation set: the report says what its cosine was judged on.
    assert f"WARNING: {LOSSY} change numerics and were judged on synthetic inputs only" in done.stdout


def test_optimize_says_when_the_sla_cannot_be_met_and_writes_the_chain(tmp_path: Path, optimize_cache: Path) -> None:
    """An impossible P99: "cannot be met", exit 1; a lossy profile falls outside a 0.999999 budget; chain written."""
    config = _tiny_config(tmp_path, optimize_cache)
    constraints = tmp_path / "constraints.json"
    raw = _constraints(sla__p99_ms=0.001, sla__accuracy={"min_cosine": 0.999999})
    constraints.write_text(json.dumps(raw))
    # eager and the lossy profile are what this verdict needs; ranking a third (jit) is the dry run's test.
    done = _optimize("--model", "tiny", "--config", str(config), "--constraints", str(constraints), "--profiles",
                     f"eager,{LOSSY}", "--layouts", "1x1", "--no-check", "--seconds", "0.3")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VERDICT: the SLA cannot be met on this box." in done.stdout and "P99" in done.stdout
    assert any(line.startswith(LOSSY) and " OUT " in line for line in done.stdout.splitlines()), done.stdout
    written = parse_config(config.read_text(), tmp_path).models["tiny"]
    assert written.profiles[-1] == "eager" and LOSSY not in written.profiles
    assert written.tolerance["min_cosine"] == 0.999999


def test_stage_split_sums_to_the_round_trip_and_names_the_biggest() -> None:
    """Client clocks plus the reply's timing split a round trip into stages that add up exactly."""
    timing = {"accepted_clock_ms": 1000.5, "queue_ms": 0.2, "dispatch_ms": 0.3, "decode_ms": 0.1,
              "model_ms": 5.0, "encode_ms": 0.1, "total_ms": 5.7}  # fmt: skip
    sample = Sample(sent_clock_ms=1000.0, received_clock_ms=1007.0, timing=timing)
    stages = sample.stages()
    assert stages["send"] == pytest.approx(0.5) and stages["reply"] == pytest.approx(0.8)
    assert sum(stages[s] for s in STAGES) == pytest.approx(stages["round_trip"]) == pytest.approx(7.0)
    table = stage_table([sample, Sample(1000.0, 1009.0, {**timing, "model_ms": 7.0, "total_ms": 7.7})])
    assert table["model"]["p50_ms"] == 5.0 and table["model"]["p99_ms"] == 7.0
    assert where_time_goes(table).startswith("model (worker: forward pass) takes")


def test_perf_stat_output_gives_rates_or_says_why_not() -> None:
    """Counted events give IPC and miss rates; a VM without a PMU gives the reason instead of numbers."""
    counted = "\n".join(
        f"{value},,{event},1000,100.00,,"
        for event, value in (("cycles", 1000), ("instructions", 2500), ("cache-references", 200),
                             ("cache-misses", 10), ("branches", 400), ("branch-misses", 4))
    )  # fmt: skip
    rates = parse_perf_stat(counted)
    assert rates["available"] and (rates["ipc"], rates["cache_miss_rate"], rates["branch_miss_rate"]) == (
        2.5,
        0.05,
        0.01,
    )
    hidden = parse_perf_stat("<not supported>,,cycles,0,100.00,,\n<not supported>,,instructions,0,100.00,,")
    assert not hidden["available"] and "cycles <not supported>" in hidden["why"]


def test_probe_against_a_live_daemon_reports_stages_counters_and_operators(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """`infervisor probe` under a bounded load: every stage's percentiles, counters or why not, the worker's ops."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    assert "no serving worker" in daemon.control({"cmd": "profile", "model": "nope"})["error"]
    assert "requests (1..10000)" in daemon.control({"cmd": "profile", "model": "tiny", "requests": 0})["error"]
    report = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "probe", "--model", "tiny", "--runtime-dir", str(daemon.runtime_dir),
         "--qps", "50", "--duration", "2", "--profile-requests", "10", "--json", str(report)],
        capture_output=True, text=True, cwd=ROOT, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    probe = json.loads(report.read_text())
    assert probe["errors"] == 0 and probe["samples"] >= 90
    assert set(probe["stages"]) == {*STAGES, "round_trip"}
    assert all(probe["stages"][s]["p50_ms"] <= probe["stages"][s]["p99.9_ms"] for s in STAGES)
    assert "available" in probe["counters"] and (probe["counters"]["available"] or probe["counters"]["why"])
    assert probe["profiled_requests"] == 10 and any(
        "linear" in op["name"] or "addmm" in op["name"] for op in probe["operators"]
    )
    assert "where the time goes:" in done.stdout
    assert probe["served"] == {"chain": ["eager"], "workers": 1, "cores_per_worker": 1, "profiles": ["eager"],
                               "checked_on": ["synthetic inputs"]}  # fmt: skip
    assert probe["clients"] == 2 and probe["measured_on"]["cpu_model"]


def test_harden_runs_every_check_against_a_live_daemon_and_fails_an_impossible_p99(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Short mode: polluted input, memory pressure and chaos pass (thermal where readable); a 0.001 ms P99 fails the
    soak (exit 1); the JSON records the chain and layout the daemon served."""
    config = {"oversubscribe": True, "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=2)}}
    daemon = start_daemon(config)
    daemon.wait_ready()
    constraints = tmp_path / "constraints.json"
    constraints.write_text(json.dumps(_constraints(sla__p99_ms=0.001)))
    results_path = tmp_path / "harden.json"
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "harden", "--model", "tiny", "--runtime-dir", str(daemon.runtime_dir),
         "--duration", "6", "--hog-mb", "128", "--constraints", str(constraints), "--json", str(results_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    document = json.loads(results_path.read_text())
    results = {r["name"]: r for r in document["results"]}
    assert [n for n, r in results.items() if r["measured"] and not r["passed"]] == ["soak"], done.stdout
    assert document["served"]["chain"] == ["eager"] and document["served"]["workers"] == 2
    assert set(results["polluted input"]["numbers"]["outcomes"]) >= {"NaN", "inf", "wrong shape", "truncated frame"}
    assert results["chaos"]["numbers"]["lost"] == 0 and len(results["chaos"]["numbers"]["events"]) == 2
    measured = sum(r["measured"] for r in results.values())
    assert f"FAILED: {measured - 1}/{measured} checks" in done.stdout
