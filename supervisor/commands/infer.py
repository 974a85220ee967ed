"""`infervisor infer`: one request from the shell, with an output summary and the latency."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from protocol.client import Client
from protocol.constants import CLIENT_SOCKET_NAME
from protocol.errors import InferenceError
from supervisor.control import ControlError, control_request
from supervisor.runtime_dir import resolve_runtime_dir


class InputError(Exception):
    """The inputs given on the command line cannot be used."""


def random_inputs(spec: list[dict[str, Any]], batch: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """Arrays of a declared input spec: normal floats, ones for integers (a valid id, mask and class alike)."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for item in spec:
        shape = tuple(batch if d is None else d for d in item["shape"])
        dtype = np.dtype(item["dtype"])
        if dtype.kind == "f":
            arrays[item["name"]] = rng.standard_normal(shape).astype(dtype)
        else:
            arrays[item["name"]] = np.ones(shape, dtype=dtype)
    return arrays


def file_inputs(values: list[str], spec: list[dict[str, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    """Load FILE.npy / NAME=FILE.npy / FILE.npz arguments into named arrays."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as bundle:
                arrays.update({key: bundle[key] for key in bundle.files})
            continue
        if not name:
            if len(spec) != 1:
                raise InputError(f"the model has {len(spec)} inputs; name each one: --input NAME=FILE.npy")
            name = spec[0]["name"]
        arrays[name] = np.load(path, allow_pickle=False)
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


def run_infer(args: argparse.Namespace) -> int:
    """Send one request and print what came back and how long it took."""
    runtime_dir = resolve_runtime_dir(args.runtime_dir, None)
    try:
        status = control_request(runtime_dir, {"cmd": "status"})
        model = status["models"].get(args.model)
        if model is None:
            print(f"infervisor infer: no model {args.model!r}; serving {sorted(status['models'])}")
            return 2
        inputs = random_inputs(model["inputs"], args.batch) if args.random else file_inputs(args.input, model["inputs"])
    except (ControlError, InputError, OSError, ValueError) as exc:
        print(f"infervisor infer: {exc}")
        return 2
    with Client(f"ipc://{Path(runtime_dir) / CLIENT_SOCKET_NAME}") as client:
        started = time.perf_counter()
        try:
            outputs, timing = client.infer_with_timing(args.model, inputs, timeout=args.timeout)
        except InferenceError as exc:
            print(
                json.dumps({"error": str(exc.code), "message": exc.message})
                if args.json
                else f"error {exc.code}: {exc.message}"
            )
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
    print(f"{args.model}: {latency_ms:.2f} ms round trip (server: {timing})")
    for out in report["outputs"]:
        extra = f" min {out['min']:.4g} max {out['max']:.4g} mean {out['mean']:.4g}" if "min" in out else ""
        top = f" top5 {out['top5']}" if "top5" in out else ""
        print(f"  {out['name']}: {out['dtype']}{out['shape']}{extra}{top}")
    return 0
