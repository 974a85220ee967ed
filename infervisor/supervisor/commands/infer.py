"""`infervisor infer`: one request from the shell, with an output summary and the latency."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from infervisor.protocol.client import Client
from infervisor.protocol.constants import CLIENT_SOCKET_NAME, DEFAULT_MAX_FRAME_BYTES
from infervisor.protocol.control_client import ControlError, control_request
from infervisor.protocol.errors import InferenceError
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir
from infervisor.supervisor.toolkit.inputs import random_inputs, random_shape


class InputError(Exception):
    """The inputs given on the command line cannot be used."""


#: The first bytes of the two file kinds `--input` takes (numpy's format, and the zip archive numpy.savez writes).
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


def frame_limit(status: dict[str, Any]) -> int:
    """The largest tensor the daemon accepts (its max_frame_bytes; the default when status does not say)."""
    limit = status.get("limits", {}).get("max_frame_bytes", status.get("max_frame_bytes"))
    return int(limit) if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_FRAME_BYTES


def check_random_size(spec: list[dict[str, Any]], batch: int, max_frame_bytes: int) -> None:
    """Refuse, before allocating anything, random inputs the daemon would refuse or this box cannot hold."""
    peak = 0
    for item in spec:
        shape = list(random_shape(item["shape"], batch))
        itemsize = np.dtype(item["dtype"]).itemsize
        nbytes = math.prod(shape) * itemsize
        if nbytes > max_frame_bytes:
            raise InputError(
                f"--batch {batch} makes input {item['name']!r} {shape} {nbytes / 2**20:,.0f} MiB, over the daemon's "
                f"frame limit of {max_frame_bytes / 2**20:,.0f} MiB (max_frame_bytes); use a smaller --batch"
            )
        # Floats are drawn as float64 and then cast: both copies exist for a moment.
        peak += nbytes + (math.prod(shape) * 8 if np.dtype(item["dtype"]).kind == "f" else 0)
    available = psutil.virtual_memory().available
    if peak > available // 2:
        raise InputError(
            f"--batch {batch} needs {peak / 2**20:,.0f} MiB to make its inputs and this box has "
            f"{available / 2**20:,.0f} MiB available; use a smaller --batch"
        )


def _load_array_file(path: str) -> Any:
    """np.load of a .npy or .npz, with what is wrong said in the CLI's terms (it never unpickles)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    if not (head.startswith(_NPY_MAGIC) or head.startswith(_ZIP_MAGICS)):
        raise InputError(f"{path} is not a .npy or .npz file (numpy.save and numpy.savez write them)")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc) or "Object arrays" in str(exc):
            raise InputError(f"{path} holds Python objects, not numeric arrays; the daemon takes numbers only") from exc
        raise InputError(f"{path} is not a readable .npy/.npz file: {exc}") from exc
    except (OSError, EOFError, zipfile.BadZipFile) as exc:  # truncated or damaged
        raise InputError(f"{path} is not a readable .npy/.npz file: {exc}") from exc


def file_inputs(values: list[str], spec: list[dict[str, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    """Load FILE.npy / NAME=FILE.npy / FILE.npz arguments into named arrays."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        loaded = _load_array_file(path)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded as bundle:
                try:
                    arrays.update({key: bundle[key] for key in bundle.files})
                except ValueError as exc:  # a member is an object array: only found when it is read
                    raise InputError(f"{path} holds Python objects, not numeric arrays: {exc}") from exc
                except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # a damaged member
                    raise InputError(f"{path} is not a readable .npz file: {exc}") from exc
            continue
        if not name:
            if len(spec) != 1:
                raise InputError(f"the model has {len(spec)} inputs; name each one: --input NAME=FILE.npy")
            name = spec[0]["name"]
        arrays[name] = loaded
    return arrays


def summarize(name: str, array: np.ndarray[Any, Any]) -> dict[str, Any]:
    """Shape, dtype, range and (for a 2-D float output) the top-5 classes of row 0."""
    summary: dict[str, Any] = {"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}
    if array.size and array.dtype.kind in "fiub":
        summary.update(min=float(array.min()), max=float(array.max()), mean=float(array.mean()))
        if array.ndim == 2 and array.dtype.kind == "f" and array.shape[1] > 5:
            top = np.argsort(array[0])[::-1][:5]
            summary["top5"] = [[int(i), round(float(array[0, i]), 4)] for i in top]
    return summary


def timing_text(timing: dict[str, Any]) -> str:
    """The server's stage times, `model 1.20 ms, total 1.31 ms, queue 0.04 ms, ...`: what a reader compares.

    Its clock readings (`accepted_clock_ms`, a point in time, not a duration) are for --json and probe only.
    """
    durations = {k.removesuffix("_ms"): v for k, v in timing.items() if k.endswith("_ms") and "_clock" not in k}
    first = [k for k in ("model", "total") if k in durations]
    order = first + [k for k in durations if k not in first]
    return ", ".join(f"{k} {float(durations[k]):.2f} ms" for k in order) or "no stage times"


def output_text(summary: dict[str, Any]) -> str:
    """One output as a line: `logits: float32 [1, 1000], min -3.1 max 9.8 mean 0.01, top-5 classes 281 (9.8), ...`."""
    line = f"{summary['name']}: {summary['dtype']} {summary['shape']}"
    if "min" in summary:
        line += f", min {summary['min']:.4g} max {summary['max']:.4g} mean {summary['mean']:.4g}"
    if "top5" in summary:
        line += ", top-5 classes of row 0 " + ", ".join(f"{i} ({score:.4g})" for i, score in summary["top5"])
    return line


def run_infer(args: argparse.Namespace) -> int:
    """Send one request and print what came back and how long it took (errors on stderr, exit 1 or 2)."""
    runtime_dir = resolve_runtime_dir(args.runtime_dir, None)
    try:
        status = control_request(runtime_dir, {"cmd": "status"})
        model = status["models"].get(args.model)
        if model is None:
            print(f"infervisor infer: no model {args.model!r}; serving {sorted(status['models'])}", file=sys.stderr)
            return 2
        if args.random:
            check_random_size(model["inputs"], args.batch, frame_limit(status))
            inputs = random_inputs(model["inputs"], args.batch)
        else:
            inputs = file_inputs(args.input, model["inputs"])
    except (ControlError, InputError) as exc:
        print(f"infervisor infer: {exc}", file=sys.stderr)
        return 2
    except MemoryError:  # the size check leaves little room for this, but a busy box can still run short
        print("infervisor infer: not enough memory to make the inputs; use a smaller --batch", file=sys.stderr)
        return 2
    with Client(f"ipc://{Path(runtime_dir) / CLIENT_SOCKET_NAME}", max_frame_bytes=frame_limit(status)) as client:
        started = time.perf_counter()
        try:
            outputs, timing = client.infer_with_timing(args.model, inputs, timeout=args.timeout)
        except InferenceError as exc:
            if args.json:
                print(json.dumps({"error": str(exc.code), "message": exc.message}))
            else:
                print(f"infervisor infer: error {exc.code}: {exc.message}", file=sys.stderr)
            return 1
        latency_ms = (time.perf_counter() - started) * 1000.0
    report = {
        "model": args.model,
        "latency_ms": round(latency_ms, 3),
        "server_timing": timing,
        "outputs": [summarize(name, array) for name, array in outputs.items()],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.model}: {latency_ms:.2f} ms round trip (server: {timing_text(timing)})")
    for out in report["outputs"]:
        print(f"  {output_text(out)}")
    return 0
