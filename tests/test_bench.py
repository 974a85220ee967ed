"""The small benchmarks run end to end and print their tables (figures are not checked: they are measurements)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def _bench(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_cold_path_prints_every_step_after_the_forward_pass_and_warm() -> None:
    """bench/cold_path.py on tiny: one row per reply step, each with both timings and their ratio."""
    out = _bench("bench/cold_path.py", "--models", "tiny", "--rounds", "3")
    rows = [line for line in out.splitlines() if line.startswith("tiny ")]
    steps = [" ".join(row.split()[1:-5]) for row in rows]
    assert steps == [
        "one syscall (getppid)",
        "result header (encode_result)",
        "worker reply: header, link send",
        "broker: decode the client header",
        "broker: check against the spec",
        "broker: encode REQUEST",
        "broker: decode REPLY",
    ]
    assert all(row.endswith("x") for row in rows)


def test_link_bench_times_both_paths() -> None:
    """bench/link.py with a 600 KB payload: a row for ZeroMQ, a row for the link, and their ratio."""
    out = _bench("bench/link.py", "--count", "20", "--size", "602112")
    assert "ZeroMQ DEALER/ROUTER, ipc" in out and "socketpair link" in out and "link / zmq p50: x" in out


def test_legs_bench_alternates_both_sides_and_splits_every_leg() -> None:
    """bench/legs.py on tiny, B with hang_factor 30: a row per side with every leg, and a range line per leg."""
    out = _bench("bench/legs.py", "--model", "tiny", "--pairs", "1", "--requests", "25", "--set", "hang_factor=30")
    legs = ("send", "dispatch", "decode", "model", "encode", "reply", "overhead")
    rows = [line.split() for line in out.splitlines() if line.startswith("1 ")]
    assert [row[1 : -len(legs)] for row in rows] == [["as", "is"], ["hang_factor=30"]]
    assert all(float(value) >= 0 for row in rows for value in row[-len(legs) :])
    for leg in legs:
        assert any(line.startswith(f"  {leg} ") and "(B lower in" in line for line in out.splitlines())


def test_legs_bench_sends_the_b_sides_input_in_shared_memory() -> None:
    """bench/legs.py --shm --both hang_factor=30: both sides set it, only B's input travels by reference."""
    out = _bench(
        "bench/legs.py", "--model", "tiny", "--pairs", "1", "--requests", "25", "--shm", "--both", "hang_factor=30"
    )
    assert "; hang_factor=30;" in out.splitlines()[0]
    rows = [line.split() for line in out.splitlines() if line.startswith("1 ")]
    assert [row[1:-7] for row in rows] == [["as", "is"], ["shm"]]
