"""The benchmarks run end to end and print their tables (figures are not checked: they are measurements)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

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


def test_batching_bench_alternates_two_live_daemons_and_sums_their_cpu(tmp_path: Path) -> None:
    """bench/batching.py on tiny, 2 rounds: each round measures both daemons, in turn, with their CPU and batches."""
    out = _bench(
        "bench/batching.py", "--models", "tiny", "--clients", "2", "--rounds", "2", "--seconds", "0.5",
        "--json", str(tmp_path / "rows.json"),
    )  # fmt: skip
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["round"], r["batching"]) for r in rows] == [(0, False), (0, True), (1, True), (1, False)]
    assert all(r["req_s"] > 0 and r["cpu_us"] > 0 and r["client_cpu_us"] > 0 and r["errors"] == 0 for r in rows)
    assert all((r["mean_batch"] is not None) == r["batching"] for r in rows)
    assert "tiny        2 clients: req_s x" in out and "cpu_us x" in out


def test_batching_bench_sets_a_key_on_both_sides_or_on_the_batching_side_alone() -> None:
    """--set changes the entry both daemons get; --set-on changes it again for the batching daemon only."""
    from bench.batching import MODELS, entry_of

    both = entry_of("tiny", ["tiny.prefetch=2", "encoder.workers=1"])
    on = entry_of("tiny", ["tiny.prefetch=1", "tiny.workers=2"], both)
    assert (both["prefetch"], both["workers"]) == (2, MODELS["tiny"][1]["workers"])
    assert (on["prefetch"], on["workers"]) == (1, 2)


def test_batching_bench_pads_each_encoder_clients_sentence_to_the_tokens_asked() -> None:
    """--tokens 32: the encoder declares [None, 32] inputs; each client's ids end in padding where its mask does."""
    from bench.batching import MODELS, request_inputs, with_tokens

    shapes, entry = with_tokens("encoder", 32)
    assert [spec["shape"] for spec in entry["inputs"]] == [[None, 32], [None, 32]]
    sentences = [request_inputs(shapes, seed) for seed in range(8)]
    for inputs in sentences:
        mask, ids = inputs["attention_mask"][0], inputs["input_ids"][0]
        length = int(mask.sum())
        assert inputs["input_ids"].shape == (1, 32) and inputs["input_ids"].dtype == np.int64
        assert 8 <= length <= 32 and (mask[:length] == 1).all() and (mask[length:] == 0).all()
        assert (ids[:length] >= 1000).all() and (ids[length:] == 0).all()
    assert len({int(inputs["attention_mask"].sum()) for inputs in sentences}) > 1
    assert with_tokens("tiny", 32) == MODELS["tiny"]


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


def _voice(tmp_path: Path) -> Path:
    """A config whose model is a TorchScript LSTM file, named relative to the config (as a user would write it)."""
    torch.manual_seed(0)

    class Voice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True)

        def forward(self, mel: torch.Tensor) -> torch.Tensor:
            return self.lstm(mel)[0][:, -1]

    torch.jit.save(torch.jit.script(Voice().eval()), str(tmp_path / "voice.pt"))
    entry = {
        "source": {"torchscript": "voice.pt"},
        "inputs": [{"name": "mel", "dtype": "float32", "shape": [None, 20, 8]}],
    }
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"voice": entry}}))
    return config


def test_bench_measures_a_model_of_a_config_file_with_its_batch_column(tmp_path: Path) -> None:
    """`bench --config F --models voice`: in process and through a daemon, per-sample ms at batch 1 and 8, and PSS."""
    config = _voice(tmp_path)
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "bench", "--config", str(config), "--models", "voice",
         "--profiles", "eager,jit", "--threads", "1", "--seconds", "0.3", "--json", str(rows_file)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    header = done.stdout.splitlines()[0].split()
    assert header[header.index("qps") + 1 : header.index("qps") + 4] == ["b1/row", "b8/row", "b8/b1"]
    rows = json.loads(rows_file.read_text())
    assert [(r["model"], r["profile"]) for r in rows] == [("voice", "eager"), ("voice", "jit")]
    assert {r["measured_at"] for r in rows} == {"20x8 (the declared shape)"}
    assert "voice measured at 20x8 (the declared shape) (in process and through the daemon)" in done.stdout
    for row in rows:
        assert set(row["per_sample_ms"]) == {"1", "8"} and all(ms > 0 for ms in row["per_sample_ms"].values())
        assert row["batch_ratio"] > 0
        assert row["daemon_p50_ms"] > 0 and row["restart_ready_s"] > 0, row
        assert row["pss_mb"] > 10 and row["process_pss_mb"] > 10, "each profile's worker by PSS"


def test_bench_names_the_models_it_knows_when_given_another(tmp_path: Path) -> None:
    """An unknown model is exit 2 with the built-ins and the config's models listed, not a traceback."""
    config = _voice(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", "bench", "--config", str(config), "--models", "speaker"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "no model 'speaker': built-ins are resnet50" in done.stderr and "has voice" in done.stderr


def test_the_audit_bench_reads_a_drift_both_arms_share_as_no_cost() -> None:
    """The box slowing by a third from the 4th window on: per-round ratios read 1, a 10% audit cost still shows."""
    from bench.audit import ratios

    order = ["on", "off", "off", "on", "on", "off", "off", "on"]  # ABBA, as bench/audit.py runs it
    speeds = [1.0, 1.0, 1.0, 0.66, 0.66, 0.66, 0.66, 0.66]  # the box, window by window

    def windows(cost: float) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for arm, speed in zip(order, speeds, strict=True):
            slower = cost if arm == "on" else 1.0
            latency = slower / speed
            rows.append({"audit": arm, "seconds": 8.0, "rows_audited": 8 if arm == "on" else 0,
                         "req_s": 1000 / latency, "p50_ms": 2 * latency, "p99_ms": 3 * latency})  # fmt: skip
        return rows

    assert ratios(windows(1.0)) == {"req_s_on_over_off": 1.0, "p99_on_over_off": 1.0, "p50_on_over_off": 1.0,
                                    "audited_rows_per_s": 1.0}  # fmt: skip
    costly = ratios(windows(1.1))
    assert (costly["p99_on_over_off"], costly["req_s_on_over_off"]) == (1.1, round(1 / 1.1, 3))


def test_the_process_tree_bench_measures_each_arm_and_a_killed_workers_way_back(tmp_path: Path) -> None:
    """bench/process_tree.py on tiny, one round of template on, off and a baseline checkout (this one): every arm's
    tree read from the kernel, a kill -9 timed back to an answer, and the ratios on/off and on/baseline."""
    from bench.daemon import builtin_entry

    config = tmp_path / "tiny.json"
    entry = builtin_entry("tiny", workers=1, cores_per_worker=1, profiles=["eager"])
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), "models": {"tiny": entry}}))
    out = tmp_path / "tree.json"
    done = subprocess.run(
        [sys.executable, "bench/process_tree.py", "--config", str(config), "--rounds", "1", "--kills", "1",
         "--requests", "5", "--idle-s", "0", "--baseline", str(ROOT), "--baseline-config", str(config),
         "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    runs = {run["arm"]: run for run in json.loads(out.read_text())}
    assert set(runs) == {"on", "off", "baseline"}
    for arm, run in runs.items():
        kinds = sorted(row["kind"] for row in run["memory"])
        forked = ["supervisor", "template", "worker"]
        assert kinds == (forked if arm != "off" else ["supervisor", "worker"]), (arm, kinds)
        assert all(row["pss"] > 1 << 20 for row in run["memory"]), run["memory"]
        assert len(run["respawn_s"]) == 1 and 0 < run["respawn_s"][0] < 120, run["respawn_s"]
    assert runs["off"]["how"]["state"] == "off" and runs["on"]["how"]["state"] == "warm"
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["on", "off", "baseline"]
    assert lines[4].startswith("on/off: worker PSS x") and lines[5].startswith("on/baseline: worker PSS x")
