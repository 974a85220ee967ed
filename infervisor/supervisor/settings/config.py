"""config.json: every top-level key declared once below (TOP_KEYS; a model entry's in model_entry.py), parsed into
frozen dataclasses.

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

from infervisor.common.strict_modes import UnsafePath, read_small_file
from infervisor.protocol.constants import DEFAULT_MAX_FRAME_BYTES, MAX_NAME_LEN
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
from infervisor.supervisor.settings.model_entry import MODEL_KEYS, ModelConfig

LOG_LEVELS = ("debug", "info", "warning", "error")
#: What throttling does: only report it, or shed concurrency (restarting workers would not cool the CPU).
THERMAL_ACTIONS = ("none", "shed")
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
class OipConfig:
    """Where the Open Inference Protocol gateway listens (infervisor/gateway/): HOST:PORT for each, or None."""

    http: str | None
    grpc: str | None


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration: one field per declaration of TOP_KEYS, then the file's digest."""

    models: dict[str, ModelConfig]
    runtime_dir: str | None
    #: Who besides the daemon's user may use infer.sock and status.sock (supervisor/host/socket_group.py); None: nobody.
    socket_group: SocketGroup | None
    #: Compiled packages and fastest-pick decisions, kept across restarts (None: the default, see cache_dir.py).
    cache_dir: str | None
    #: Public keys (files) a bundle must be signed by to be imported (`infervisor build --import`).
    bundle_keys: tuple[str, ...]
    log_level: str
    tcp_endpoint: str | None
    curve: CurveConfig | None
    #: Let metrics_listen name an address that is not loopback (the operator's explicit choice).
    metrics_allow_remote: bool
    #: HOST:PORT of the Prometheus endpoint (infervisor/supervisor/observe/exposition.py), or None for none.
    metrics_listen: str | None
    #: Let `oip` name addresses that are not loopback.
    oip_allow_remote: bool
    #: The OIP gateway's addresses (supervisor/workers/gateway_process.py), or None for no gateway.
    oip: OipConfig | None
    oversubscribe: bool
    #: Fork children from a template that imported torch once (infervisor/supervisor/workers/child_home.py).
    warm_template: bool
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
    #: Stop the background builder while a request is in flight (infervisor/supervisor/lifecycle/build_gate.py).
    build_yield: bool
    #: The least share of wall time a builder keeps while serving stays busy.
    build_min_share: float
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


def _read_bundle_keys(ctx: ReadContext, raw: Any, path: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(item, str) and item for item in raw):
        ctx.fields.fail(path, "must be a list of public key file paths")
        return ()
    return tuple(str(Path(item) if Path(item).is_absolute() else ctx.base / item) for item in raw)


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


def _check_listen(ctx: ReadContext, listen: str, path: str, remote_flag: str) -> str | None:
    """A HOST:PORT to listen on: HOST an IP address or localhost, loopback unless `remote_flag` was set true."""
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
    if not _is_loopback(host) and not ctx.earlier[remote_flag]:
        # What runs, how much, and the models themselves: beyond this box only when the operator says so.
        ctx.fields.fail(path, f"host {host!r} is not loopback; that needs `{remote_flag}: true`")
    return listen


def _read_metrics_listen(ctx: ReadContext, raw: Any, path: str) -> str | None:
    listen = ctx.fields.string_or_null(raw, path)
    return None if listen is None else _check_listen(ctx, listen, path, "metrics_allow_remote")


def _read_oip(ctx: ReadContext, raw: Any, path: str) -> OipConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw or set(raw) - {"http", "grpc"}:
        ctx.fields.fail(path, 'must be null or an object with "http" and/or "grpc" (HOST:PORT each)')
        return None
    ends = {key: ctx.fields.string_or_null(raw.get(key), f"{path}.{key}") for key in ("http", "grpc")}
    checked = {k: v if v is None else _check_listen(ctx, v, f"{path}.{k}", "oip_allow_remote") for k, v in ends.items()}
    if checked["http"] is not None and checked["http"] == checked["grpc"]:
        ctx.fields.fail(path, "http and grpc need two addresses")
    return OipConfig(checked["http"], checked["grpc"])


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
    Key("bundle_keys", Custom(_read_bundle_keys, "a list of file paths", default=[]), Applied.LIVE,
        "the ed25519 public keys (`infervisor build --keygen`) a cache bundle must be signed by for `infervisor "
        "build --import` to install it; several for a key rotation. Each file must pass the "
        "[strict modes](#strict-modes) ([deploy.md](deploy.md#signed-bundles))."),
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
    Key("oip_allow_remote", Flag(False), Applied.DAEMON_RESTART,
        "let `oip` name addresses that are not loopback (a pod's IP, behind KServe's or the mesh's TLS)."),
    Key("oip", Custom(_read_oip, '`{"http": HOST:PORT, "grpc": HOST:PORT}` (either may be null), or null'),
        Applied.DAEMON_RESTART,
        "serve the Open Inference Protocol (KServe v2) over HTTP and gRPC there, from a gateway process that is a "
        "client of the broker ([protocol.md](protocol.md#open-inference-protocol)); a host that is not loopback is "
        "refused unless `oip_allow_remote` is true."),
    Key("oversubscribe", Flag(False), Applied.DAEMON_RESTART,
        "when the workers ask for more physical cores than the cpuset has, share cores round-robin (status shows "
        "`shared_cores`) instead of refusing to start."),
    Key("warm_template", Flag(True), Applied.DAEMON_RESTART,
        "start every child process (workers, builders, audit processes) as a fork of one template process that "
        "imported torch and ran nothing: they share its imported pages and skip the import "
        "([more](architecture.md#processes-and-threads)); `false` execs a fresh interpreter for each."),
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
    Key("build_yield", Flag(True), Applied.LIVE,
        "stop the background builder's processes (its compilers too) while any request is in flight and continue "
        "them when none is, except while it times its candidates; `false`: it runs at idle priority only "
        "([more](#the-background-builder))."),
    Key("build_min_share", Fraction(0.25, 1.0), Applied.LIVE,
        "while requests keep coming, the background builder still runs at least this share of the time (stopped "
        "at most 1 s in a row), so a box that is never idle finishes its build; `0`: it waits for a moment with no "
        "request in flight; `1`: never stopped."),
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
        "once anything is held, a request that would take the total past this is answered `OVERLOADED`, "
        "whichever connection sends it (a fresh one too; [protocol.md](protocol.md#74-delivery))."),
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
