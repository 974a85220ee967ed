"""constraints.json: the four rows a delivery is signed against (seed 2, section 2), validated with JSON paths.

hardware (what the box is), sla (what is promised, including the accuracy budget), data (what the
inputs look like) and operations (what may be changed on site). Every later toolkit command reads
its limits from here, so a number the operator cannot meet is found before the contract is signed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.supervisor.settings.fields import FieldReader, join_path

STORAGE_TYPES = ("ssd", "hdd", "emmc", "nvme", "network")


class ConstraintsError(Exception):
    """constraints.json is unreadable or wrong; `problems` holds one `path: why` per mistake."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Hardware:
    """The target box."""

    cpu_model: str | None
    memory_mb: int
    gpu_allowed: bool
    storage: str


@dataclass(frozen=True)
class Accuracy:
    """How far from eager fp32 an optimisation may move outputs (the same measure as a model's tolerance)."""

    min_cosine: float
    max_abs_error: float | None
    top1: bool


@dataclass(frozen=True)
class Sla:
    """What is promised."""

    cold_start_ms: float
    p99_ms: float
    min_qps: float
    uptime_hours: float
    accuracy: Accuracy


@dataclass(frozen=True)
class InputShape:
    """One input: each dim fixed (an int) or a [min, max] range."""

    name: str
    dims: tuple[int | tuple[int, int], ...]


@dataclass(frozen=True)
class Data:
    """What requests carry."""

    inputs: tuple[InputShape, ...]
    typical_batch: int
    max_tokens: int | None


@dataclass(frozen=True)
class Operations:
    """What may be done on site."""

    kernel_params_changeable: bool
    drivers_installable: bool
    restart_acceptable: bool
    maintenance_window: str | None


@dataclass(frozen=True)
class Constraints:
    """The whole file."""

    hardware: Hardware
    sla: Sla
    data: Data
    operations: Operations


def _section(r: FieldReader, raw: dict[str, Any], key: str, allowed: set[str]) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        r.fail(key, f"must be an object with keys {', '.join(sorted(allowed))}")
        return {}
    r.check_keys(value, key, allowed)
    return value


def _dims(r: FieldReader, raw: Any, path: str) -> tuple[int | tuple[int, int], ...]:
    if not isinstance(raw, list) or not raw:
        r.fail(path, "must be a non-empty array of dims: an integer, or [min, max] for a range")
        return ()
    dims: list[int | tuple[int, int]] = []
    for index, dim in enumerate(raw):
        where = f"{path}[{index}]"
        if type(dim) is int and dim >= 1:
            dims.append(dim)
        elif (
            isinstance(dim, list) and len(dim) == 2 and all(type(d) is int and d >= 1 for d in dim) and dim[0] <= dim[1]
        ):
            dims.append((dim[0], dim[1]))
        else:
            r.fail(where, f"must be an integer >= 1 or [min, max] with 1 <= min <= max, got {dim!r}")
    return tuple(dims)


def _inputs(r: FieldReader, raw: Any, path: str) -> tuple[InputShape, ...]:
    if not isinstance(raw, list) or not raw:
        r.fail(path, "must be a non-empty array of {name, shape}")
        return ()
    shapes: list[InputShape] = []
    for index, item in enumerate(raw):
        where = f"{path}[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            r.fail(where, "must be an object with a non-empty `name` and a `shape`")
            continue
        r.check_keys(item, where, {"name", "shape"})
        shapes.append(InputShape(item["name"], _dims(r, item.get("shape"), f"{where}.shape")))
    return tuple(shapes)


def parse_constraints(text: str) -> Constraints:
    """Validate constraints.json text; ConstraintsError lists every problem with its JSON path."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintsError([f"(file): not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"]) from exc
    if not isinstance(raw, dict):
        raise ConstraintsError(["(file): must be a JSON object with hardware, sla, data and operations"])
    r = FieldReader()
    r.check_keys(raw, "", {"hardware", "sla", "data", "operations", "comment"})
    hw = _section(r, raw, "hardware", {"cpu_model", "memory_mb", "gpu_allowed", "storage"})
    storage = hw.get("storage", "ssd")
    if storage not in STORAGE_TYPES:
        r.fail("hardware.storage", f"must be one of {', '.join(STORAGE_TYPES)}, got {storage!r}")
    sla = _section(r, raw, "sla", {"cold_start_ms", "p99_ms", "min_qps", "uptime_hours", "accuracy"})
    accuracy_raw = sla.get("accuracy", {})
    if not isinstance(accuracy_raw, dict):
        r.fail("sla.accuracy", "must be an object with min_cosine, max_abs_error, top1")
        accuracy_raw = {}
    r.check_keys(accuracy_raw, "sla.accuracy", {"min_cosine", "max_abs_error", "top1"})
    data = _section(r, raw, "data", {"inputs", "typical_batch", "max_tokens"})
    ops = _section(
        r, raw, "operations",
        {"kernel_params_changeable", "drivers_installable", "restart_acceptable", "maintenance_window"},
    )  # fmt: skip
    min_cosine = r.number(accuracy_raw, "min_cosine", "sla.accuracy", 0.99, -1.0)
    if min_cosine > 1.0:
        r.fail("sla.accuracy.min_cosine", f"must be at most 1, got {min_cosine}")
    constraints = Constraints(
        hardware=Hardware(
            cpu_model=r.optional_string(hw, "cpu_model", "hardware"),
            memory_mb=r.integer(hw, "memory_mb", "hardware", 1, 64),
            gpu_allowed=r.boolean(hw, "gpu_allowed", "hardware", False),
            storage=storage if storage in STORAGE_TYPES else "ssd",
        ),
        sla=Sla(
            cold_start_ms=r.number(sla, "cold_start_ms", "sla", 1.0, 1.0),
            p99_ms=r.number(sla, "p99_ms", "sla", 1.0, 0.001),
            min_qps=r.number(sla, "min_qps", "sla", 0.0, 0.0),
            uptime_hours=r.number(sla, "uptime_hours", "sla", 0.0, 0.0),
            accuracy=Accuracy(
                min_cosine=min_cosine,
                max_abs_error=r.optional_number(accuracy_raw, "max_abs_error", "sla.accuracy", 0.0),
                top1=r.boolean(accuracy_raw, "top1", "sla.accuracy", False),
            ),
        ),
        data=Data(
            inputs=_inputs(r, data.get("inputs"), join_path("data", "inputs")),
            typical_batch=r.integer(data, "typical_batch", "data", 1, 1),
            max_tokens=r.optional_integer(data, "max_tokens", "data", 1),
        ),
        operations=Operations(
            kernel_params_changeable=r.boolean(ops, "kernel_params_changeable", "operations", False),
            drivers_installable=r.boolean(ops, "drivers_installable", "operations", False),
            restart_acceptable=r.boolean(ops, "restart_acceptable", "operations", True),
            maintenance_window=r.optional_string(ops, "maintenance_window", "operations"),
        ),
    )
    for required, keys in (("hardware", ("memory_mb",)), ("sla", ("cold_start_ms", "p99_ms", "min_qps"))):
        section = hw if required == "hardware" else sla
        for key in keys:
            if key not in section:
                r.fail(f"{required}.{key}", "is required")
    if r.problems:
        raise ConstraintsError(r.problems)
    return constraints


def load_constraints(path: Path) -> Constraints:
    """Read and validate a constraints file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConstraintsError([f"(file): cannot read {path}: {exc.strerror}"]) from exc
    return parse_constraints(text)
