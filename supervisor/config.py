"""config.json: parsed into frozen dataclasses; every problem names the JSON path of the bad key."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.profiles import PROFILE_NAMES
from protocol.constants import DEFAULT_MAX_FRAME_BYTES, DTYPE_ITEMSIZE, MAX_NAME_LEN, MAX_RANK
from protocol.launch import PICK_MODES, ModelSource
from protocol.tensors import TensorSpec
from supervisor.fields import FieldReader

LOG_LEVELS = ("debug", "info", "warning", "error")
#: What throttling does: only report it, or shed concurrency (restarting workers would not cool the CPU).
THERMAL_ACTIONS = ("none", "shed")
#: surge: the replacement warms beside the old worker (capacity stays N); drain_first: the old one
#: drains and exits before its replacement starts (capacity N-1 for that slot; for boxes whose cores
#: or memory cannot hold both at once).
ROLLOUT_STRATEGIES = ("surge", "drain_first")
SOURCE_KINDS = ("builtin", "torchscript", "exported", "python")
_PYTHON_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _is_loopback(host: str) -> bool:
    """True for localhost and literal loopback addresses (a name like 127.example.com is not one)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_TCP_ENDPOINT = re.compile(r"tcp://(?P<host>[^:/\[\]]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})")


class ConfigError(Exception):
    """The config file is unusable; `problems` lists `path: why` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class CurveConfig:
    """CURVE keys for the tcp endpoint: the server's secret certificate, a folder of client public certificates."""

    server_secret_key: str
    authorized_clients: str


@dataclass(frozen=True)
class ModelConfig:
    """One served model and its worker pool."""

    name: str
    source: ModelSource
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...] | None
    workers: int
    cores_per_worker: int
    use_smt: bool
    threads: int | None
    queue_size: int
    warmup_iterations: int
    max_retries: int
    prefetch: int
    max_memory_mb: int | None
    # Recycling and monitors (all applied live):
    rollout: str
    profiles: tuple[str, ...]
    pick: str
    tolerance: dict[str, Any]
    channels_last: bool
    #: Absolute path of the int8_static calibration set (.npz), or None for seeded random inputs.
    calibration: str | None
    #: Absolute path of the inputs profiles are checked on (.npz), or None for seeded random inputs.
    validation: str | None
    max_age_s: float | None
    max_requests: int | None
    recycle_jitter: float
    rss_soft_mb: int | None
    rss_hard_mb: int | None
    leak_mb_per_min: float | None
    leak_window_s: float
    drift_factor: float | None
    drift_window: int
    canary_interval_s: float | None
    canary_tolerance: float


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration."""

    models: dict[str, ModelConfig]
    runtime_dir: str | None
    #: Compiled packages and fastest-pick decisions, kept across restarts (None: the default, see cache_dir.py).
    cache_dir: str | None
    log_level: str
    tcp_endpoint: str | None
    curve: CurveConfig | None
    oversubscribe: bool
    #: Keep the supervisor on the allowed cpus no worker holds (supervisor/affinity.py).
    pin_supervisor: bool
    #: A CPU latency QoS request in µs held while serving (supervisor/cpu_latency.py); None holds none.
    cpu_latency_us: int | None
    #: While a worker holds a request, the broker rehearses its path this often when idle (supervisor/rehearsal.py).
    keep_warm_ms: int | None
    heartbeat_interval_ms: int
    heartbeat_liveness: int
    hang_factor: float
    hang_min_s: float
    worker_start_timeout_s: float
    shutdown_grace_s: float
    max_frame_bytes: int
    restart_window_s: float
    max_restarts: int
    monitor_interval_s: float
    thermal_sysfs_root: str
    thermal_action: str
    thermal_max_c: float | None
    digest: str


def _read_source(r: FieldReader, raw: Any, path: str, base: Path) -> ModelSource:
    if not isinstance(raw, dict) or len(raw) != 1:
        r.fail(path, f"must be an object with exactly one of {', '.join(SOURCE_KINDS)}")
        return ModelSource("builtin", "invalid")
    ((kind, value),) = raw.items()
    if kind not in SOURCE_KINDS:
        r.fail(f"{path}.{kind}", f"unknown source kind (use one of {', '.join(SOURCE_KINDS)})")
    elif not isinstance(value, str) or not value:
        r.fail(f"{path}.{kind}", "must be a non-empty string")
    elif kind == "builtin":
        return ModelSource("builtin", name=value)
    elif kind == "python":
        if not _PYTHON_FACTORY.fullmatch(value):
            r.fail(f"{path}.python", f"must be 'package.module:callable', got {value!r}")
        return ModelSource("python", name=value)
    else:
        file = Path(value) if Path(value).is_absolute() else base / value
        if not file.is_file():
            # Caught here, a missing model file is a refused reload instead of a worker that cannot start.
            r.fail(f"{path}.{kind}", f"{file} is not an existing file")
        return ModelSource(kind, path=str(file))
    return ModelSource("builtin", "invalid")


def _read_inputs(r: FieldReader, raw: Any, path: str) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or not raw:
        r.fail(path, "must be a non-empty array of {name, dtype, shape}")
        return ()
    specs: list[TensorSpec] = []
    for index, item in enumerate(raw):
        where = f"{path}[{index}]"
        if not isinstance(item, dict):
            r.fail(where, "must be an object")
            continue
        r.check_keys(item, where, {"name", "dtype", "shape", "allow_non_finite"})
        name, dtype, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            r.fail(f"{where}.name", "must be a non-empty string")
            continue
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            r.fail(f"{where}.dtype", f"must be one of {', '.join(sorted(DTYPE_ITEMSIZE))}, got {dtype!r}")
            continue
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_RANK
            or not all(d is None or (type(d) is int and 1 <= d < 2**31) for d in shape)
        ):
            r.fail(
                f"{where}.shape",
                f"must be an array of at most {MAX_RANK} positive integers or null (dynamic), got {shape!r}",
            )
            continue
        if any(spec.name == name for spec in specs):
            r.fail(f"{where}.name", f"input {name!r} is declared twice")
            continue
        allow = r.boolean(item, "allow_non_finite", where, False)
        specs.append(TensorSpec(name, dtype, tuple(shape), allow))
    return tuple(specs)


def _read_profiles(r: FieldReader, raw: Any, path: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(p, str) for p in raw):
        r.fail(path, f"must be a non-empty array of profile names ({', '.join(PROFILE_NAMES)}), got {raw!r}")
        return ("eager",)
    for index, name in enumerate(raw):
        if name not in PROFILE_NAMES:
            r.fail(f"{path}[{index}]", f"unknown profile {name!r}; available: {', '.join(PROFILE_NAMES)}")
    if len(set(raw)) != len(raw):
        r.fail(path, "lists a profile twice")
    return tuple(raw)


def _read_tolerance(r: FieldReader, raw: Any, path: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        r.fail(path, "must be an object with min_cosine, max_abs_error, top1")
        return {}
    r.check_keys(raw, path, {"min_cosine", "max_abs_error", "top1"})
    cosine = r.number(raw, "min_cosine", path, 0.999, -1.0)
    if cosine > 1.0:
        r.fail(f"{path}.min_cosine", f"must be at most 1, got {cosine}")
    return {
        "min_cosine": cosine,
        "max_abs_error": r.optional_number(raw, "max_abs_error", path, 0.0),
        "top1": r.boolean(raw, "top1", path, False),
    }


_MODEL_KEYS = {
    "source", "inputs", "outputs", "workers", "cores_per_worker", "use_smt", "threads",
    "queue_size", "warmup_iterations", "max_retries", "prefetch", "max_memory_mb", "rollout", "profiles", "tolerance",
    "channels_last", "pick", "calibration", "validation",
    "max_age_s",
    "max_requests", "recycle_jitter", "rss_soft_mb", "rss_hard_mb", "leak_mb_per_min", "leak_window_s", "drift_factor",
    "drift_window", "canary_interval_s", "canary_tolerance",
}  # fmt: skip


def _read_data_file(r: FieldReader, raw: dict[str, Any], key: str, path: str, base: Path) -> str | None:
    """An .npz path (relative to config.json's folder) that must exist, as an absolute path."""
    value = r.optional_string(raw, key, path)
    if value is None:
        return None
    file = Path(value) if Path(value).is_absolute() else base / value
    if not file.is_file():
        r.fail(f"{path}.{key}", f"no such file: {file}")
    return str(file)


def _check_data_file(r: FieldReader, file: str | None, specs: tuple[TensorSpec, ...], where: str) -> None:
    """A calibration/validation .npz holds one array per input, samples along dim 0, each sample fitting the spec."""
    if file is None or not Path(file).is_file():
        return
    import numpy as np  # only when a data file is configured: validating a config needs no numpy otherwise

    if any(s.shape and s.shape[0] not in (None, 1) for s in specs):
        r.fail(where, "needs inputs whose first dim is the batch (null or 1): samples are taken along it")
        return
    try:
        with np.load(file, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        r.fail(where, f"cannot read {file} as .npz: {exc}")
        return
    samples = set()
    for spec in specs:
        array = arrays.get(spec.name)
        if array is None:
            r.fail(where, f"{file} has no array {spec.name!r} (it has {sorted(arrays)})")
            continue
        fits = (
            array.ndim == len(spec.shape)
            and array.dtype.name == spec.dtype
            and all(want is None or want == got for want, got in zip(spec.shape[1:], array.shape[1:], strict=False))
        )
        if not fits:
            r.fail(where, f"array {spec.name!r} is {array.dtype.name}{list(array.shape)}; expected {spec.describe()}")
        samples.add(array.shape[0] if array.ndim else 0)
    if len(samples) > 1 or 0 in samples:
        r.fail(where, "its arrays must share a non-empty first (sample) dimension")


def _read_model(r: FieldReader, name: str, raw: Any, base: Path) -> ModelConfig | None:
    path = f"models.{name}"
    if not _MODEL_NAME.fullmatch(name) or len(name) > MAX_NAME_LEN:
        r.fail(path, "model names use letters, digits, '_', '.', '-' and start with a letter or digit")
    if not isinstance(raw, dict):
        r.fail(path, "must be an object")
        return None
    r.check_keys(raw, path, _MODEL_KEYS)
    outputs = raw.get("outputs")
    if outputs is not None and (not isinstance(outputs, list) or not all(isinstance(o, str) and o for o in outputs)):
        r.fail(f"{path}.outputs", "must be an array of output names or null")
        outputs = None
    rollout = raw.get("rollout", "surge")
    if rollout not in ROLLOUT_STRATEGIES:
        r.fail(f"{path}.rollout", f"must be one of {', '.join(ROLLOUT_STRATEGIES)}, got {rollout!r}")
        rollout = "surge"
    memory = raw.get("max_memory_mb")
    if memory is not None and (type(memory) is not int or memory < 512):
        r.fail(f"{path}.max_memory_mb", f"must be an integer >= 512 (MB) or null, got {memory!r}")
        memory = None
    pick = raw.get("pick", "first")
    if pick not in PICK_MODES:
        r.fail(f"{path}.pick", f"must be one of {', '.join(PICK_MODES)}, got {pick!r}")
        pick = "first"
    inputs = _read_inputs(r, raw.get("inputs"), f"{path}.inputs")
    calibration = _read_data_file(r, raw, "calibration", path, base)
    validation = _read_data_file(r, raw, "validation", path, base)
    _check_data_file(r, calibration, inputs, f"{path}.calibration")
    _check_data_file(r, validation, inputs, f"{path}.validation")
    threads = raw.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        r.fail(f"{path}.threads", f"must be a positive integer or null (= one per pinned cpu), got {threads!r}")
        threads = None
    return ModelConfig(
        name=name,
        source=_read_source(r, raw.get("source"), f"{path}.source", base),
        inputs=inputs,
        outputs=tuple(outputs) if outputs else None,
        workers=r.integer(raw, "workers", path, 1, 1, 256),
        cores_per_worker=r.integer(raw, "cores_per_worker", path, 1, 1, 1024),
        use_smt=r.boolean(raw, "use_smt", path, False),
        threads=threads,
        queue_size=r.integer(raw, "queue_size", path, 64, 0, 1_000_000),
        warmup_iterations=r.integer(raw, "warmup_iterations", path, 3, 1, 1000),
        max_retries=r.integer(raw, "max_retries", path, 2, 0, 10),
        prefetch=r.integer(raw, "prefetch", path, 1, 1, 16),
        max_memory_mb=memory,
        rollout=rollout,
        profiles=_read_profiles(r, raw.get("profiles", ["eager"]), f"{path}.profiles"),
        pick=pick,
        tolerance=_read_tolerance(r, raw.get("tolerance", {}), f"{path}.tolerance"),
        channels_last=r.boolean(raw, "channels_last", path, False),
        calibration=calibration,
        validation=validation,
        max_age_s=r.optional_number(raw, "max_age_s", path, 1.0),
        max_requests=r.optional_integer(raw, "max_requests", path, 1),
        recycle_jitter=r.fraction(raw, "recycle_jitter", path, 0.1, 0.5),
        rss_soft_mb=r.optional_integer(raw, "rss_soft_mb", path, 1),
        rss_hard_mb=r.optional_integer(raw, "rss_hard_mb", path, 1),
        leak_mb_per_min=r.optional_number(raw, "leak_mb_per_min", path, 0.001),
        leak_window_s=r.number(raw, "leak_window_s", path, 120.0, 1.0),
        drift_factor=r.optional_number(raw, "drift_factor", path, 1.01),
        # Baseline and recent window both live in the 2048-sample latency buffer.
        drift_window=r.integer(raw, "drift_window", path, 100, 5, 1000),
        canary_interval_s=r.optional_number(raw, "canary_interval_s", path, 0.1),
        canary_tolerance=r.number(raw, "canary_tolerance", path, 1e-4, 0.0),
    )


_TOP_KEYS = {
    "models", "runtime_dir", "log_level", "tcp_endpoint", "oversubscribe", "heartbeat_interval_ms",
    "heartbeat_liveness", "hang_factor", "hang_min_s", "worker_start_timeout_s", "shutdown_grace_s",
    "max_frame_bytes", "restart_window_s", "max_restarts", "curve", "monitor_interval_s", "thermal_sysfs_root",
    "thermal_action", "thermal_max_c", "cache_dir", "pin_supervisor",
    "cpu_latency_us", "keep_warm_ms",
}  # fmt: skip


def _read_curve(r: FieldReader, raw: Any, base: Path) -> CurveConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        r.fail("curve", "must be an object with server_secret_key and authorized_clients")
        return None
    r.check_keys(raw, "curve", {"server_secret_key", "authorized_clients"})
    paths: list[str] = []
    for key, want_dir in (("server_secret_key", False), ("authorized_clients", True)):
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            r.fail(f"curve.{key}", "must be a path")
            continue
        path = Path(value) if Path(value).is_absolute() else base / value
        if not (path.is_dir() if want_dir else path.is_file()):
            r.fail(f"curve.{key}", f"{path} is not an existing {'directory' if want_dir else 'file'}")
            continue
        paths.append(str(path))
    return CurveConfig(*paths) if len(paths) == 2 else None


def parse_config(text: str, base: Path) -> Config:
    """Validate config text; relative model paths resolve against `base`."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"(file): not valid JSON: {exc}"]) from exc
    except RecursionError as exc:
        raise ConfigError(["(file): JSON nested too deeply"]) from exc
    if not isinstance(raw, dict):
        raise ConfigError(["(file): must be a JSON object"])
    r = FieldReader()
    r.check_keys(raw, "", _TOP_KEYS)
    models_raw = raw.get("models")
    models: dict[str, ModelConfig] = {}
    if not isinstance(models_raw, dict) or not models_raw:
        r.fail("models", "must be a non-empty object of model name -> model")
    else:
        for name, model_raw in models_raw.items():
            model = _read_model(r, name, model_raw, base)
            if model is not None:
                models[name] = model
    log_level = raw.get("log_level", "info")
    if log_level not in LOG_LEVELS:
        r.fail("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
        log_level = "info"
    thermal_action = raw.get("thermal_action", "none")
    if thermal_action not in THERMAL_ACTIONS:
        r.fail("thermal_action", f"must be one of {', '.join(THERMAL_ACTIONS)}, got {thermal_action!r}")
        thermal_action = "none"
    tcp = r.optional_string(raw, "tcp_endpoint", "")
    curve = _read_curve(r, raw.get("curve"), base)
    if tcp is not None:
        match = _TCP_ENDPOINT.fullmatch(tcp)
        if match is None or not 1 <= int(match["port"]) <= 65535:
            r.fail("tcp_endpoint", f"must look like tcp://127.0.0.1:5555 (port 1-65535), got {tcp!r}")
        elif not _is_loopback(match["host"]) and curve is None:
            # Without CURVE anyone who can reach the port could send requests: off-box needs keys.
            r.fail("tcp_endpoint", f"host {match['host']!r} is not loopback; that needs `curve` keys configured")
    config = Config(
        models=models,
        runtime_dir=r.optional_string(raw, "runtime_dir", ""),
        cache_dir=r.optional_string(raw, "cache_dir", ""),
        log_level=log_level,
        tcp_endpoint=tcp,
        curve=curve,
        oversubscribe=r.boolean(raw, "oversubscribe", "", False),
        pin_supervisor=r.boolean(raw, "pin_supervisor", "", True),
        # The kernel reads an s32 and treats 2,000,000,000 µs as "no limit".
        cpu_latency_us=None
        if raw.get("cpu_latency_us") is None
        else r.integer(raw, "cpu_latency_us", "", 0, 0, 2_000_000_000),
        # At most the loop's housekeeping interval (20 ms): a longer idle wait would delay heartbeats and deadlines.
        keep_warm_ms=None if raw.get("keep_warm_ms") is None else r.integer(raw, "keep_warm_ms", "", 1, 1, 10),
        heartbeat_interval_ms=r.integer(raw, "heartbeat_interval_ms", "", 500, 10, 60_000),
        heartbeat_liveness=r.integer(raw, "heartbeat_liveness", "", 10, 2, 1000),
        hang_factor=r.number(raw, "hang_factor", "", 20.0, 1.0),
        hang_min_s=r.number(raw, "hang_min_s", "", 10.0, 0.1),
        worker_start_timeout_s=r.number(raw, "worker_start_timeout_s", "", 300.0, 1.0),
        shutdown_grace_s=r.number(raw, "shutdown_grace_s", "", 10.0, 0.0),
        max_frame_bytes=r.integer(raw, "max_frame_bytes", "", DEFAULT_MAX_FRAME_BYTES, 1024, 2**40),
        restart_window_s=r.number(raw, "restart_window_s", "", 60.0, 1.0),
        max_restarts=r.integer(raw, "max_restarts", "", 5, 1, 1000),
        monitor_interval_s=r.number(raw, "monitor_interval_s", "", 1.0, 0.05),
        thermal_sysfs_root=r.optional_string(raw, "thermal_sysfs_root", "") or "/sys",
        thermal_action=thermal_action,
        thermal_max_c=r.optional_number(raw, "thermal_max_c", "", 1.0),
        digest=hashlib.sha256(text.encode()).hexdigest()[:16],
    )
    if r.problems:
        raise ConfigError(r.problems)
    return config


def load_config(path: Path) -> Config:
    """Read and validate a config file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"(file): cannot read {path}: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"(file): {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"]) from exc
    return parse_config(text, path.parent.resolve())
