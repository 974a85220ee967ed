"""Start `infervisor serve` for a benchmark and wait until every worker serves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from infervisor.protocol.control_client import DaemonNotReady, await_status

ROOT = Path(__file__).resolve().parent.parent

#: Input name and batch-1 shape of the built-ins the benchmarks drive.
SHAPES: dict[str, tuple[str, tuple[int, ...]]] = {
    "tiny": ("x", (1, 16)),
    "resnet18": ("image", (1, 3, 224, 224)),
    "resnet50": ("image", (1, 3, 224, 224)),
}


def builtin_entry(model: str, **extra: Any) -> dict[str, Any]:
    """A config.json model entry for a built-in with a dynamic batch dimension."""
    name, shape = SHAPES[model]
    inputs = [{"name": name, "dtype": "float32", "shape": [None, *shape[1:]]}]
    return {"source": {"builtin": model}, "inputs": inputs, **extra}


def start_daemon(
    config: dict[str, Any], runtime_dir: Path, env: dict[str, str] | None = None, root: Path = ROOT
) -> subprocess.Popen[bytes]:
    """Write the config beside the runtime dir, start the daemon of checkout `root` (log beside it too), wait for it.

    Another checkout runs on its own `.venv` where it has one: its workers import its package, not this one's.
    """
    runtime_dir.parent.mkdir(parents=True, exist_ok=True)
    path = runtime_dir.parent / f"{runtime_dir.name}-config.json"
    path.write_text(json.dumps(config))
    log = (runtime_dir.parent / f"{runtime_dir.name}-daemon.log").open("wb")
    own_python = root / ".venv" / "bin" / "python"
    python = str(own_python) if root != ROOT and own_python.exists() else sys.executable
    process = subprocess.Popen(
        [python, "-m", "infervisor", "serve", "--config", str(path), "--runtime-dir", str(runtime_dir)],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )

    def every_worker_serving(status: dict[str, Any]) -> bool | None:
        workers = [w for m in status["models"].values() for w in m["workers"]]
        return True if all(w["state"] == "serving" for w in workers) else None

    try:
        await_status(process, runtime_dir, every_worker_serving, 300, "not every worker serving")
    except DaemonNotReady as exc:
        raise SystemExit(f"{exc}; see {log.name}") from None
    return process


def stop_daemon(process: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    """SIGTERM, `grace` seconds to stop in order, then SIGKILL; reaped before returning."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
