"""config.json: every key declared once below (MODEL_KEYS, TOP_KEYS), parsed into frozen dataclasses.

Each problem names the JSON path of the bad key. How to add a key: docs/configuration.md, "Adding a config key".
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.common.accuracy import DEFAULT_MAX_REL_ERROR, FEW_VALUES_PER_ROW
from infervisor.common.builtin_models import BUILTIN_MODELS
from infervisor.common.profiles import PROFILE_NAMES
from infervisor.common.strict_modes import UnsafePath, read_small_file
from infervisor.protocol.constants import DEFAULT_MAX_FRAME_BYTES, MAX_NAME_LEN
from infervisor.protocol.launch import PICK_MODES, ModelSource
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.host.socket_group import SocketGroup, SocketGroupError, lookup_group
from infervisor.supervisor.settings.config_keys import (
    Applied,
    Choice,
    Custom,
    Flag,
    Fraction,
    Integer,
    Key,
    Number,
    ReadContext,
    Text,
    read_object,
)
from infervisor.supervisor.settings.curve_keys import curve_problems
from infervisor.supervisor.settings.fields import FieldReader
from infervisor.supervisor.settings.module_lookup import module_missing
from infervisor.supervisor.settings.tensor_keys import read_data_file, read_inputs, read_outputs

LOG_LEVELS = ("debug", "info", "warning", "error")
#: What throttling does: only report it, or shed concurrency (restarting workers would not cool the CPU).
THERMAL_ACTIONS = ("none", "shed")
#: surge: the replacement warms beside the old worker (capacity stays N); drain_first: the old one
#: drains and exits before its replacement starts (capacity N-1 for that slot; for boxes whose cores
#: or memory cannot hold both at once).
ROLLOUT_STRATEGIES = ("surge", "drain_first")
#: When a model's profiles are built: by the background builder while the workers serve, or in each worker's start.
BUILD_MODES = ("background", "at_start")
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
_LISTEN = re.compile(r"(?P<host>[^:/\[\]]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})")


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
class BatchingConfig:
    """Server-side batching of one model (Triton's dynamic batcher terms); see supervisor/routing/batcher.py."""

    #: Rows (dim 0, summed over the joined requests) one forward pass may carry.
    max_batch_size: int
    #: How long the oldest queued request may wait for companions before its batch goes as it is.
    max_queue_delay_us: int
    #: Batch sizes (rows) to aim for, e.g. the model's compiled buckets; empty: any size up to the maximum.
    preferred_batch_sizes: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """One served model and its worker pool: its name, then one field per declaration of MODEL_KEYS."""

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
    rollout: str
    profiles: tuple[str, ...]
    pick: str
    #: "background": serve first, the builder builds behind; "at_start": each worker builds before READY.
    build: str
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
    batching: BatchingConfig | None


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration: one field per declaration of TOP_KEYS, then the file's digest."""

    models: dict[str, ModelConfig]
    runtime_dir: str | None
    #: Who besides the daemon's user may use infer.sock and status.sock (supervisor/host/socket_group.py); None: nobody.
    socket_group: SocketGroup | None
    #: Compiled packages and fastest-pick decisions, kept across restarts (None: the default, see cache_dir.py).
    cache_dir: str | None
    log_level: str
    tcp_endpoint: str | None
    curve: CurveConfig | None
    #: Let metrics_listen name an address that is not loopback (the operator's explicit choice).
    metrics_allow_remote: bool
    #: HOST:PORT of the Prometheus endpoint (infervisor/supervisor/observe/exposition.py), or None for none.
    metrics_listen: str | None
    oversubscribe: bool
    #: Keep the supervisor on the allowed cpus no worker holds (infervisor/supervisor/host/affinity.py).
    pin_supervisor: bool
    #: A CPU latency QoS request in µs held while serving (infervisor/supervisor/host/cpu_latency.py); None holds none.
    cpu_latency_us: int | None
    heartbeat_interval_ms: int
    heartbeat_liveness: int
    hang_factor: float
    hang_min_s: float
    worker_start_timeout_s: float
    #: The per-profile build limit of a starting worker (infervisor/supervisor/workers/start_clock.py).
    compile_timeout_s: float
    #: Cap on the background builder's private writable memory (RLIMIT_DATA) in MB; None: the worker's cap.
    builder_memory_mb: int | None
    shutdown_grace_s: float
    max_frame_bytes: int
    client_budget_mb: int
    clients_budget_mb: int
    restart_window_s: float
    max_restarts: int
    monitor_interval_s: float
    thermal_sysfs_root: str
    thermal_action: str
    thermal_max_c: float | None
    digest: str


def _read_source(ctx: ReadContext, raw: Any, path: str) -> ModelSource:
    r = ctx.fields
    if not isinstance(raw, dict) or len(raw) != 1:
        r.fail(path, f"must be an object with exactly one of {', '.join(SOURCE_KINDS)}")
        return ModelSource("builtin", "invalid")
    ((kind, value),) = raw.items()
    if kind not in SOURCE_KINDS:
        r.fail(f"{path}.{kind}", f"unknown source kind (use one of {', '.join(SOURCE_KINDS)})")
    elif not isinstance(value, str) or not value:
        r.fail(f"{path}.{kind}", "must be a non-empty string")
    elif kind == "builtin":
        if value not in BUILTIN_MODELS:
            # Caught here, a misspelt built-in is a refused reload instead of a worker that cannot start.
            r.fail(f"{path}.builtin", f"no built-in model {value!r}; built-ins are {', '.join(BUILTIN_MODELS)}")
        return ModelSource("builtin", name=value)
    elif kind == "python":
        if not _PYTHON_FACTORY.fullmatch(value):
            r.fail(f"{path}.python", f"must be 'package.module:callable', got {value!r}")
        elif (missing := module_missing(value.partition(":")[0], ctx.base)) is not None:
            r.fail(f"{path}.python", f"cannot import {value!r}: {missing}")
        return ModelSource("python", name=value, search_dir=str(ctx.base))
    else:
        file = Path(value) if Path(value).is_absolute() else ctx.base / value
        if not file.is_file():
            # Caught here, a missing model file is a refused reload instead of a worker that cannot start.
            r.fail(f"{path}.{kind}", f"{file} is not an existing file")
        return ModelSource(kind, path=str(file))
    return ModelSource("builtin", "invalid")


def _read_profiles(ctx: ReadContext, raw: Any, path: str) -> tuple[str, ...]:
    r = ctx.fields
    if not isinstance(raw, list) or not raw or not all(isinstance(p, str) for p in raw):
        r.fail(path, f"must be a non-empty array of profile names ({', '.join(PROFILE_NAMES)}), got {raw!r}")
        return ("eager",)
    for index, name in enumerate(raw):
        if name not in PROFILE_NAMES:
            r.fail(f"{path}[{index}]", f"unknown profile {name!r}; available: {', '.join(PROFILE_NAMES)}")
    if len(set(raw)) != len(raw):
        r.fail(path, "lists a profile twice")
    return tuple(raw)


def _read_tolerance(ctx: ReadContext, raw: Any, path: str) -> dict[str, Any]:
    r = ctx.fields
    if not isinstance(raw, dict):
        r.fail(path, "must be an object with min_cosine, max_rel_error, max_abs_error, top1")
        return {}
    r.check_keys(raw, path, {"min_cosine", "max_rel_error", "max_abs_error", "top1"})
    cosine = r.number(raw, "min_cosine", path, 0.999, -1.0)
    if cosine > 1.0:
        r.fail(f"{path}.min_cosine", f"must be at most 1, got {cosine}")
    # Absent: the default applies; null: switched off (the cosine alone then judges few-value outputs too).
    relative = raw.get("max_rel_error", DEFAULT_MAX_REL_ERROR)
    return {
        "min_cosine": cosine,
        "max_rel_error": None if relative is None else r.number(raw, "max_rel_error", path, DEFAULT_MAX_REL_ERROR, 0.0),
        "max_abs_error": r.optional_number(raw, "max_abs_error", path, 0.0),
        "top1": r.boolean(raw, "top1", path, False),
    }


def _read_batching(ctx: ReadContext, raw: Any, path: str) -> BatchingConfig | None:
    r = ctx.fields
    if raw is None:
        return None
    if not isinstance(raw, dict):
        r.fail(path, "must be an object with max_batch_size, max_queue_delay_us, preferred_batch_sizes, or null")
        return None
    r.check_keys(raw, path, {"max_batch_size", "max_queue_delay_us", "preferred_batch_sizes"})
    size = r.integer(raw, "max_batch_size", path, 8, 2, 4096)
    delay = r.integer(raw, "max_queue_delay_us", path, 0, 0, 10_000_000)
    preferred = raw.get("preferred_batch_sizes", [])
    if not isinstance(preferred, list) or not all(type(p) is int and 1 <= p <= size for p in preferred):
        r.fail(f"{path}.preferred_batch_sizes", f"must be an array of integers in [1, max_batch_size={size}]")
        preferred = []
    inputs = ctx.earlier.get("inputs") or ()
    if any(not spec.shape or spec.shape[0] is not None for spec in inputs):
        r.fail(path, "needs every input's first dim to be the batch (null): requests are joined along it")
    return BatchingConfig(size, delay, tuple(sorted(set(preferred))))


def _choices(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{name}`" for name in names)


# fmt: off
#: A model entry's keys, in the order they are read and documented (`inputs` before the data files checked against it).
MODEL_KEYS: tuple[Key, ...] = (
    Key("source", Custom(_read_source, f"object with exactly one key: {_choices(SOURCE_KINDS)}", required=True),
        Applied.ROLLING,
        "where the model comes from; a model file must exist when the config is validated ([more](#source))."),
    Key("inputs",
        Custom(read_inputs, "non-empty array of `{name, dtype, shape, allow_non_finite, synthetic}`", required=True),
        Applied.ROLLING,
        "the model's inputs, in the order its `forward` takes them, each dim fixed, any size (null) or a range "
        "`[min, max]`, and the synthetic data the daemon draws for it; admission checks requests against new ones at "
        "once ([more](#inputs))."),
    Key("outputs", Custom(read_outputs, "array of non-empty strings, or null (`[]` = null)"), Applied.ROLLING,
        "names for the model's outputs in order; default: the built-in's names, the keys of a returned dict, else "
        "`output`, `output_1`, ..."),
    Key("workers", Integer(1, 1, 256), Applied.SCALED,
        "worker processes for this model."),
    Key("cores_per_worker", Integer(1, 1, 1024), Applied.ROLLING,
        "physical cores per worker, all on one NUMA node, disjoint from other workers."),
    Key("use_smt", Flag(False), Applied.ROLLING,
        "also give each worker the SMT siblings of its cores."),
    Key("threads", Integer(None, 1, why="must be a positive integer or null (= one per pinned cpu)"),
        Applied.ROLLING,
        "torch intra-op threads; null: one per pinned logical CPU."),
    Key("queue_size", Integer(64, 0, 1_000_000), Applied.LIVE,
        "requests waiting for a worker; one more is answered `OVERLOADED` at once. A smaller value refuses new "
        "requests until the queue is below it."),
    Key("warmup_iterations", Integer(3, 1, 1000), Applied.ROLLING,
        "forward passes on inputs of the declared spec before READY; the last pass's outputs are the worker's canary "
        "reference."),
    Key("max_retries", Integer(2, 0, 10), Applied.LIVE,
        "times a request is re-dispatched after its worker died or hung; then `WORKER_LOST`."),
    Key("prefetch", Integer(1, 1, 16), Applied.LIVE,
        "requests a worker may hold at once (1 = one at a time) ([more](#prefetch))."),
    Key("max_memory_mb", Integer(None, 512, why="must be an integer >= 512 (MB) or null"), Applied.ROLLING,
        "cap on the worker's private writable memory (`RLIMIT_DATA`): a request that would allocate past it fails "
        "inside torch and is answered `INTERNAL`; the worker keeps serving, and the box's OOM killer is never woken."),
    Key("rollout", Choice("surge", ROLLOUT_STRATEGIES), Applied.LIVE,
        "how a [rolling restart](#rolling-restarts) replaces this model's workers."),
    Key("profiles", Custom(_read_profiles, f"array of {_choices(PROFILE_NAMES)}", ["eager"]), Applied.ROLLING,
        "the optimisation chain ([optimization.md](optimization.md)); a profile serves only if the CPU allows it, "
        "it builds, and it matches eager fp32 within `tolerance` ([more](#profiles))."),
    Key("pick", Choice("first", PICK_MODES), Applied.ROLLING,
        "`first`: the first profile of the chain that passes serves; `fastest`: every one is built, validated and "
        "timed, and the fastest that passes serves ([more](#pick))."),
    Key("build", Choice("background", BUILD_MODES), Applied.ROLLING,
        "`background`: workers serve at once from what is ready (a verified cached package, else eager), and a "
        "background builder builds, checks and times the chain, then the workers switch to its pick by rolling "
        "replacement; `at_start`: each worker builds before it is ready, as `infervisor build` does "
        "([more](#the-background-builder))."),
    Key("calibration", Custom(read_data_file, "path (relative to config.json) or null"), Applied.ROLLING,
        "an `.npz` that `int8_static` observes to set activation scales; null: seeded random inputs "
        "([more](#calibration-and-validation))."),
    Key("validation", Custom(read_data_file, "path (relative to config.json) or null"), Applied.ROLLING,
        "an `.npz` of the inputs every profile is checked on against eager fp32; null: seeded random inputs "
        "([more](#calibration-and-validation))."),
    Key("batching",
        Custom(_read_batching, "`{max_batch_size, max_queue_delay_us, preferred_batch_sizes}` or null"),
        Applied.ROLLING,
        "join requests of this model into one forward pass (off when null) ([more](#batching))."),
    Key("tolerance",
        Custom(_read_tolerance,
               "`min_cosine` (-1..1), `max_rel_error` (≥ 0 or null), `max_abs_error` (≥ 0 or null), `top1` (bool)",
               {"min_cosine": 0.999, "max_rel_error": DEFAULT_MAX_REL_ERROR}),
        Applied.ROLLING,
        "how close to eager fp32 a profile must stay on the golden (or validation) inputs: the cosine of the worst "
        "sample (each row of the batch, all outputs joined); on each output with at most "
        f"{FEW_VALUES_PER_ROW} values per row (a score, a probability, a box), where a cosine cannot fail, the "
        "largest difference as a fraction of eager's largest magnitude on that output; the largest absolute "
        "difference; and argmax agreement on every row ([more](#tolerance))."),
    Key("channels_last", Flag(False), Applied.ROLLING,
        "NHWC memory layout for CNNs: the module and every 4-D input are converted (inputs arrive NCHW on the wire "
        "as usual) ([more](#channels_last))."),
    Key("max_age_s", Number(None, 1.0), Applied.LIVE,
        "recycle a worker this long after its READY (± jitter)."),
    Key("max_requests", Integer(None, 1), Applied.LIVE,
        "recycle a worker after this many replies (± jitter)."),
    Key("recycle_jitter", Fraction(0.1, 0.5), Applied.LIVE,
        "each process's age and request limits are `limit × (1 + u)`, `u` uniform in ±`recycle_jitter`."),
    Key("rss_soft_mb", Integer(None, 1), Applied.LIVE,
        "RSS above this (MiB) → recycle."),
    Key("rss_hard_mb", Integer(None, 1), Applied.LIVE,
        "RSS above this (MiB) → SIGKILL. Not checked against `rss_soft_mb`."),
    Key("leak_mb_per_min", Number(None, 0.001), Applied.LIVE,
        "RSS growth above this (MiB/min, least-squares slope) → recycle."),
    Key("leak_window_s", Number(120.0, 1.0), Applied.LIVE,
        "RSS history the slope is fitted over."),
    Key("drift_factor", Number(None, 1.01), Applied.LIVE,
        "recent median latency / the worker's own baseline above this → recycle."),
    # Baseline and recent window both live in the 2048-sample latency buffer.
    Key("drift_window", Integer(100, 5, 1000), Applied.LIVE,
        "requests in the baseline and in the recent window (the per-worker latency buffer keeps the last 2048)."),
    Key("canary_interval_s", Number(None, 0.1), Applied.LIVE,
        "period of canaries."),
    Key("canary_tolerance", Number(1e-4, 0.0), Applied.LIVE,
        "a canary fails when its largest absolute error exceeds `canary_tolerance × max(1, scale)`."),
)
# fmt: on


def _read_models(ctx: ReadContext, raw: Any, path: str) -> dict[str, ModelConfig]:
    models: dict[str, ModelConfig] = {}
    if not isinstance(raw, dict) or not raw:
        ctx.fields.fail(path, "must be a non-empty object of model name -> model")
        return models
    for name, entry in raw.items():
        where = f"{path}.{name}"
        if not _MODEL_NAME.fullmatch(name) or len(name) > MAX_NAME_LEN:
            ctx.fields.fail(where, "model names use letters, digits, '_', '.', '-' and start with a letter or digit")
        if not isinstance(entry, dict):
            ctx.fields.fail(where, "must be an object")
            continue
        models[name] = ModelConfig(name=name, **read_object(ctx.fields, MODEL_KEYS, entry, where, ctx.base))
    return models


def _read_curve(ctx: ReadContext, raw: Any, path: str) -> CurveConfig | None:
    r = ctx.fields
    if raw is None:
        return None
    if not isinstance(raw, dict):
        r.fail(path, "must be an object with server_secret_key and authorized_clients")
        return None
    r.check_keys(raw, path, {"server_secret_key", "authorized_clients"})
    paths: list[str] = []
    for key, want_dir in (("server_secret_key", False), ("authorized_clients", True)):
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            r.fail(f"{path}.{key}", "must be a path")
            continue
        file = Path(value) if Path(value).is_absolute() else ctx.base / value
        if not (file.is_dir() if want_dir else file.is_file()):
            r.fail(f"{path}.{key}", f"{file} is not an existing {'directory' if want_dir else 'file'}")
            continue
        paths.append(str(file))
    for problem in curve_problems(Path(paths[0]), Path(paths[1])) if len(paths) == 2 else ():
        r.fail(path, problem)
    return CurveConfig(*paths) if len(paths) == 2 else None


def _read_socket_group(ctx: ReadContext, raw: Any, path: str) -> SocketGroup | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (str, int)) or raw == "":
        ctx.fields.fail(path, f"must be a group name, a numeric gid or null, got {raw!r}")
        return None
    try:
        # Looked up now, so a group that does not exist is a config error before anything starts.
        return lookup_group(raw)
    except SocketGroupError as exc:
        ctx.fields.fail(path, str(exc))
        return None


def _read_tcp_endpoint(ctx: ReadContext, raw: Any, path: str) -> str | None:
    tcp = ctx.fields.string_or_null(raw, path)
    if tcp is None:
        return None
    match = _TCP_ENDPOINT.fullmatch(tcp)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        ctx.fields.fail(path, f"must look like tcp://127.0.0.1:5555 (port 1-65535), got {tcp!r}")
    elif not _is_loopback(match["host"]) and ctx.earlier["curve"] is None:
        # Without CURVE anyone who can reach the port could send requests: off-box needs keys.
        ctx.fields.fail(path, f"host {match['host']!r} is not loopback; that needs `curve` keys configured")
    return tcp


def _read_metrics_listen(ctx: ReadContext, raw: Any, path: str) -> str | None:
    listen = ctx.fields.string_or_null(raw, path)
    if listen is None:
        return None
    match = _LISTEN.fullmatch(listen)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        ctx.fields.fail(path, f"must look like 127.0.0.1:9464 (HOST:PORT, PORT 1-65535), got {listen!r}")
        return None
    host = match["host"]
    try:
        if host != "localhost":
            ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        # A name would be resolved at bind time, to whatever it means then: an address says where it listens.
        ctx.fields.fail(path, f"HOST must be an IP address or localhost, got {host!r}")
        return None
    if not _is_loopback(host) and not ctx.earlier["metrics_allow_remote"]:
        # Metrics say what runs, how much and where it hurts: beyond this box only when the operator says so.
        ctx.fields.fail(path, f"host {host!r} is not loopback; that needs `metrics_allow_remote: true`")
    return listen


# fmt: off
#: The top-level keys, in the order they are read and documented (`curve` before the tcp_endpoint rule that needs it).
TOP_KEYS: tuple[Key, ...] = (
    Key("models", Custom(_read_models, "non-empty object", required=True), Applied.PER_MODEL,
        "model name → model entry ([below](#model-entry)). Names match `[A-Za-z0-9][A-Za-z0-9_.-]*`, at most "
        f"{MAX_NAME_LEN} characters."),
    Key("runtime_dir", Text(), Applied.DAEMON_RESTART,
        "socket directory; `--runtime-dir` wins over it; default order in the README."),
    Key("socket_group", Custom(_read_socket_group, "a group name that exists, a numeric gid, or null"),
        Applied.DAEMON_RESTART,
        "the local client group: `infer.sock` and `status.sock` 0660 in it and the runtime directory 0750, and "
        "shared-memory inputs of the group are read; `control.sock` stays 0600. null: all private to the daemon's "
        "user ([more](#socket_group))."),
    Key("cache_dir", Text(), Applied.ROLLING,
        "where compiled packages (`aoti`, `int8_*`), fastest-pick decisions and torch.compile's cache are kept "
        "across restarts ([default](#cache_dir)); it must pass the [strict modes](#strict-modes)."),
    Key("log_level", Choice("info", LOG_LEVELS), Applied.LIVE,
        "the least severe log event written."),
    Key("curve",
        Custom(_read_curve, '`{"server_secret_key": FILE, "authorized_clients": DIR}` (both must exist, with '
               'their keys, and pass the strict modes) or null'),
        Applied.DAEMON_RESTART,
        "zmq certificates (`zmq.auth.create_certificates`) making the tcp endpoint a CURVE server that admits only "
        "the public keys found in `authorized_clients`. The ipc endpoint is not affected (it is guarded by file "
        "permissions)."),
    Key("tcp_endpoint", Custom(_read_tcp_endpoint, "`tcp://HOST:PORT`, PORT 1..65535, or null"),
        Applied.DAEMON_RESTART,
        "extra client endpoint on its own socket. A host that is not loopback (`localhost`, 127.0.0.0/8, `[::1]`) "
        "is refused unless `curve` is set."),
    Key("metrics_allow_remote", Flag(False), Applied.DAEMON_RESTART,
        "let `metrics_listen` name an address that is not loopback, such as `0.0.0.0` in a pod whose IP "
        "Prometheus scrapes."),
    Key("metrics_listen", Custom(_read_metrics_listen, "`HOST:PORT` (HOST an IP address or `localhost`), or null"),
        Applied.DAEMON_RESTART,
        "serve Prometheus metrics over HTTP there, e.g. `127.0.0.1:9464`; a host that is not loopback is refused "
        "unless `metrics_allow_remote` is true. `infervisor metrics` prints the same text without it "
        "([operations.md](operations.md#metrics))."),
    Key("oversubscribe", Flag(False), Applied.DAEMON_RESTART,
        "when the workers ask for more physical cores than the cpuset has, share cores round-robin (status shows "
        "`shared_cores`) instead of refusing to start."),
    Key("pin_supervisor", Flag(True), Applied.LIVE,
        "keep the supervisor (every thread: broker loop, ZeroMQ I/O, file watcher) on the allowed cpus no worker "
        "holds, so it never shares a core with a model ([more](#pin_supervisor))."),
    # The kernel reads an s32 and treats 2,000,000,000 µs as "no limit".
    Key("cpu_latency_us", Integer(None, 0, 2_000_000_000), Applied.LIVE,
        "a CPU latency QoS request (`/dev/cpu_dma_latency`) held while the daemon runs: idle CPUs use no sleep "
        "state that takes longer than this to leave; `0`: they poll ([more](#cpu_latency_us))."),
    Key("heartbeat_interval_ms", Integer(500, 10, 60_000), Applied.ROLLING,
        "in-band heartbeat period, both ways."),
    Key("heartbeat_liveness", Integer(10, 2, 1000), Applied.ROLLING,
        "an idle serving worker silent for this many intervals is killed and replaced; a worker that hears nothing "
        "from the supervisor for as long exits (exit 5)."),
    Key("hang_factor", Number(20.0, 1.0), Applied.LIVE,
        "a busy worker is declared hung (SIGKILL) when the head of its pipeline made no progress for "
        "`max(hang_min_s, hang_factor × its mean warm-up iteration time)`."),
    Key("hang_min_s", Number(10.0, 0.1), Applied.LIVE,
        "floor of the hang budget above."),
    Key("worker_start_timeout_s", Number(300.0, 1.0), Applied.LIVE,
        "a starting worker is killed once its loading, checking, timing and warm-up together took longer than this; "
        "building profiles is not counted here but against `compile_timeout_s` ([more](#the-build-phase))."),
    Key("compile_timeout_s", Number(900.0, 1.0), Applied.LIVE,
        "the longest one profile's build may take in a starting worker (export, quantize, compile or load its "
        "packages, or wait for a sibling's compile of them); past it the worker is killed and its successor builds "
        "that profile again, keeping the packages already done; after two overruns within an hour the profile is "
        "skipped ([more](#the-build-phase))."),
    Key("builder_memory_mb", Integer(None, 512, why="must be an integer >= 512 (MB) or null"), Applied.LIVE,
        "cap on the background builder's private writable memory (`RLIMIT_DATA`); past it the profile being built "
        "is refused with the reason and the serving workers are untouched; null: the model's `max_memory_mb`, else "
        "half the box's memory ([more](#the-background-builder))."),
    Key("shutdown_grace_s", Number(10.0, 0.0), Applied.LIVE,
        "on SIGTERM, queued and in-flight requests get this long to finish; the rest are answered `SHUTTING_DOWN`. "
        "A retiring (draining) worker is SIGKILLed if it has not exited `shutdown_grace_s` + 5 s after it began "
        "draining."),
    Key("max_frame_bytes", Integer(DEFAULT_MAX_FRAME_BYTES, 1024, 2**40), Applied.DAEMON_RESTART,
        "largest tensor frame, and largest input a client leaves in shared memory (the worker copies it out); a "
        "longer frame is answered `INVALID_INPUT`, one more than 64 KiB longer closes the connection "
        "(`ZMQ_MAXMSGSIZE`)."),
    Key("client_budget_mb", Integer(64, 1, 2**20), Applied.LIVE,
        "bytes one client connection may hold of the daemon: its requests in hand (frames and the shared-memory "
        "bytes they name) plus replies it has not read; past it, its next request is answered `OVERLOADED`."),
    Key("clients_budget_mb", Integer(256, 1, 2**20), Applied.LIVE,
        "the same, all client connections together: a local user may open as many connections as it likes, so "
        "past this the next request of any client that already holds something is answered `OVERLOADED`."),
    Key("restart_window_s", Number(60.0, 1.0), Applied.LIVE,
        "window for counting a slot's failures."),
    Key("max_restarts", Integer(5, 1, 1000), Applied.LIVE,
        "failures (exits not asked for: crash, hang or heartbeat kill, a monitor's KILL) within the window after "
        "which the slot is `FAILED` (no more respawns; `infervisor restart` replaces it). A load that fails twice "
        "with the same error fails the slot at once. When every slot of every model has failed, the daemon stays up "
        "in state `down` until a reload or restart."),
    Key("monitor_interval_s", Number(1.0, 0.05), Applied.LIVE,
        "period of the [monitors](#monitors) (also the granularity of canaries)."),
    Key("thermal_sysfs_root", Text("/sys"), Applied.LIVE,
        "where the thermal monitor reads sysfs; used as given, not relative to the config file (a test hook). A new "
        "one starts a fresh thermal monitor."),
    Key("thermal_action", Choice("none", THERMAL_ACTIONS), Applied.LIVE,
        "what throttling does: `none` only reports it; `shed` routes to half of each model's workers while "
        "throttled."),
    Key("thermal_max_c", Number(None, 1.0), Applied.LIVE,
        "a zone at or above this temperature (°C) counts as throttling, besides rising throttle counters."),
)
# fmt: on


#: Keys earlier versions read, with what to tell a config that still has one (refused like any bad key).
RETIRED_TOP_KEYS = {
    "keep_warm_ms": "removed: the broker no longer rehearses its request path (no measured gain); delete the key",
}


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
    for key in sorted(RETIRED_TOP_KEYS.keys() & raw.keys()):
        r.fail(key, RETIRED_TOP_KEYS[key])
    values = read_object(r, TOP_KEYS, {k: v for k, v in raw.items() if k not in RETIRED_TOP_KEYS}, "", base)
    if r.problems:
        raise ConfigError(r.problems)
    return Config(**values, digest=hashlib.sha256(text.encode()).hexdigest()[:16])


def load_config(path: Path, source_dir: Path | None = None) -> Config:
    """Read and validate a config file; relative model files and python modules are found in `source_dir`, by
    default the file's own folder (a scratch copy of a user's config names the user's folder)."""
    try:
        # Never blocks (a FIFO is refused by its fstat, a huge file by its size) and never reads a file another
        # user could have written: the loop that calls this on a reload serves requests meanwhile.
        text = read_small_file(path, "config").decode()
    except UnsafePath as exc:
        raise ConfigError([f"(file): {exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"(file): {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"]) from exc
    return parse_config(text, (source_dir or path.parent).resolve())
