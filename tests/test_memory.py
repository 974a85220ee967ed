"""What a worker costs: no compile residue after a first start, and PSS per worker in status and the metrics."""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import zmq

from infervisor.protocol.client_messages import InferRequest, encode_infer
from infervisor.protocol.tensors import TensorDesc
from infervisor.worker.models import build_builtin
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for

#: A first start's worker may hold this much more than a cached start's (builds leave 2-3x without the restart).
FIRST_START_BOUND = 1.25


def _config(cache: Path) -> dict[str, Any]:
    return {
        "cache_dir": str(cache),
        "oversubscribe": True,
        # Both starts exec'd: a worker that built re-execs a fresh interpreter, which holds its own import of torch
        # where a fork of the warm template shares the template's; the residue of a build is what is measured here.
        "warm_template": False,
        "worker_start_timeout_s": 600,
        "compile_timeout_s": 600,
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["aoti", "eager"])},
    }


def _served_worker(daemon: Daemon) -> tuple[dict[str, Any], int]:
    """The one tiny worker after 20 requests (answered as eager does), and its PSS read from the kernel (bytes)."""
    daemon.wait_ready(timeout=600)
    x = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(1, 16)
    with torch.inference_mode():
        want = build_builtin("tiny")(torch.from_numpy(x)).numpy()
    with daemon.client() as client:
        for _ in range(20):
            got = client.infer("tiny", {"x": x})["y"]
            # The package's weights were unmapped from its library file after loading (infervisor/worker/memory.py).
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    (worker,) = daemon.status()["models"]["tiny"]["workers"]
    return worker, int(psutil.Process(worker["pid"]).memory_full_info().pss)


def test_a_worker_that_built_its_package_restarts_from_the_cache_and_costs_what_a_cached_start_does(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Empty cache: the worker compiles aoti, execs itself (same pid), loads the package; PSS near a cached start."""
    cache = tmp_path / "shared-cache"
    first = start_daemon(_config(cache))
    built, built_pss = _served_worker(first)
    assert built["profile"] == "aoti", built
    assert any(note.startswith("compiled and cached") for note in built["profile_build"]) is False, built
    assert any(note.startswith("restarted the process after") for note in built["profile_build"]), built
    restarts = [e for e in first.log_events() if e.get("event") == "worker_restarting_after_build"]
    assert len(restarts) == 1, "one restart, never a second"
    assert built["restarts"] == 0, "the exec is the same worker, not a respawn"
    assert built["pss"] and built["pss"] > 10 * 2**20, built
    first.stop()

    cached, cached_pss = _served_worker(start_daemon(_config(cache)))
    assert any(note.startswith("loaded cached package") for note in cached["profile_build"]), cached
    assert not any(note.startswith("restarted the process") for note in cached["profile_build"]), cached
    assert built_pss <= FIRST_START_BOUND * cached_pss, (built_pss / 2**20, cached_pss / 2**20)


def test_status_shows_each_workers_pss_as_a_column_and_in_json(start_daemon: Callable[..., Daemon]) -> None:
    """`infervisor status` has a pss MB column; `status --json` carries each worker's pss, at most its rss."""
    daemon = start_daemon({"oversubscribe": True, "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    command = [sys.executable, "-m", "infervisor", "status", "--runtime-dir", str(daemon.runtime_dir)]
    table = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60, check=True).stdout
    header = next(line.split() for line in table.splitlines() if line.split()[:2] == ["slot", "pid"])
    assert header[header.index("rss") : header.index("rss") + 4] == ["rss", "MB", "pss", "MB"], table
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    (worker,) = json.loads(done.stdout)["models"]["tiny"]["workers"]
    assert 10 * 2**20 < worker["pss"] <= worker["rss"], worker


def test_a_worker_imports_no_sympy_before_it_needs_one() -> None:
    """The worker's modules leave sympy (33 MB and 0.2 s of every start) to the export paths that use it."""
    code = "import sys, infervisor.worker.serve; print('sympy' in sys.modules)"
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_mismatched_large_frames_from_many_connections_leave_no_memory_behind(
    start_daemon: Callable[..., Daemon],
) -> None:
    """64 connections x 2 x 16 MB frames not matching their header: all refused, supervisor RSS back under 120 MB."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    supervisor = psutil.Process(daemon.process.pid)
    frame = os.urandom(16 * 2**20)
    header = encode_infer(InferRequest(1, "tiny", (TensorDesc("x", "float32", (1, 16)),)))
    context: zmq.Context[Any] = zmq.Context()
    sockets = []
    try:
        for _ in range(64):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(daemon.endpoint)
            sockets.append(sock)
        for sock in sockets:
            for _ in range(2):
                sock.send_multipart([b"", header, frame], copy=False)
        replies = []
        deadline = time.monotonic() + 120
        for sock in sockets:
            for _ in range(2):
                assert sock.poll(max(0, int((deadline - time.monotonic()) * 1000))), "a refusal never came"
                replies.append(sock.recv_multipart()[-1])
        assert all(b"INVALID_INPUT" in reply for reply in replies)
        # The connections stay open, as an attacker's would: their small blocks must not pin the freed large ones.
        wait_for(lambda: supervisor.memory_info().rss <= 120 * 2**20, 10, "the supervisor's RSS back under 120 MB")
    finally:
        for sock in sockets:
            sock.close()
        context.term()
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)


def test_the_weights_of_a_package_whose_unpacked_library_was_removed_are_still_released(tmp_path: Path) -> None:
    """A library mapped from an unpacked folder that is gone since (`... (deleted)`) still has its pages dropped."""
    from infervisor.worker.memory import drop_package_weight_pages, maps_weights_files

    assert not maps_weights_files(Path("/proc/self/maps").read_text()), "no package: smaps is not read at all"

    library = tmp_path / "aotinductor_x" / "model" / "weights.wrapper.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(os.urandom(4 << 20))
    with library.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        before = bytes(mapped[:: mmap.PAGESIZE])  # every page resident
        shutil.rmtree(tmp_path / "aotinductor_x")  # what profiles/package_scratch.py does after the load
        assert maps_weights_files(Path("/proc/self/maps").read_text())
        assert drop_package_weight_pages() >= 4 << 20
        assert bytes(mapped[:: mmap.PAGESIZE]) == before  # read again from the unlinked file
    finally:
        mapped.close()


_PAGE_OUT_CHILD = """
import mmap, sys
from pathlib import Path
from infervisor.worker.memory import page_out_unshared_library_pages

def mapped(path):
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)

def resident(path):
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line[0].isupper():
            inside = line.endswith(path)
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return rss

own, shared = mapped(sys.argv[1]), mapped(sys.argv[2])
before = bytes(own[:: mmap.PAGESIZE]), bytes(shared[:: mmap.PAGESIZE])
resident_before = resident(sys.argv[1]), resident(sys.argv[2])
advised = page_out_unshared_library_pages()
print(advised, *resident_before, resident(sys.argv[1]), resident(sys.argv[2]),
      (bytes(own[:: mmap.PAGESIZE]), bytes(shared[:: mmap.PAGESIZE])) == before)
"""


def _filesystem(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point that holds it, from /proc/self/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fs_type, *_ = line.split()
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fs_type
    return kind


def test_the_template_pages_out_library_pages_only_it_maps_and_keeps_those_a_child_maps(tmp_path: Path) -> None:
    """MADV_PAGEOUT drops a read-only file mapping's pages no other process maps, keeps shared ones, loses no byte."""
    if tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2]) < (5, 4):
        pytest.skip("MADV_PAGEOUT came with Linux 5.4")
    if _filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a tmpfs file's pages are memory, not a file the kernel can read back")
    own, shared = tmp_path / "own.so", tmp_path / "shared.so"
    for path in (own, shared):
        path.write_bytes(os.urandom(8 << 20))
    with shared.open("rb") as file:
        ours = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        bytes(ours[:: mmap.PAGESIZE])  # this process maps every page of `shared` as well: the child's are not its own
        out = subprocess.run([sys.executable, "-c", _PAGE_OUT_CHILD, str(own), str(shared)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()  # fmt: skip
    finally:
        ours.close()
    advised, own_before, shared_before, own_after, shared_after = (int(v) for v in out[:5])
    assert advised >= 16 << 20, "both read-only file mappings advised"
    assert own_before == shared_before == 8 << 20
    assert own_after <= own_before // 8, "the pages only the process mapped went back to the kernel"
    assert shared_after == shared_before, "the pages another process maps stayed"
    assert out[5] == "True", "every byte read back the same"
