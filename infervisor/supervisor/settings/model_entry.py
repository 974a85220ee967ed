"""A model entry of config.json: its keys (MODEL_KEYS, each declared once), parsed into a frozen ModelConfig.

Each problem names the JSON path of the bad key. How to add a key: docs/configuration.md, "Adding a config key".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.common.accuracy import FEW_VALUES_PER_ROW
from infervisor.common.builtin_models import BUILTIN_MODELS
from infervisor.common.profiles import PROFILE_NAMES
from infervisor.common.recorded_inputs import DEFAULT_CAP_MB
from infervisor.protocol.launch import PICK_MODES, ModelSource
from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.settings.audit_keys import DEFAULT_AUDIT_BUDGET, AuditConfig, read_audit
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
)
from infervisor.supervisor.settings.module_lookup import module_missing
from infervisor.supervisor.settings.state_keys import read_state
from infervisor.supervisor.settings.stream_keys import STREAM_KEYS
from infervisor.supervisor.settings.tensor_keys import read_data_file, read_inputs, read_outputs, read_validation_file
from infervisor.supervisor.settings.timing_keys import read_typical_shape
from infervisor.supervisor.settings.tolerance_keys import DEFAULT_TOLERANCE, read_tolerance

#: surge: the replacement warms beside the old worker (capacity stays N); drain_first: the old one
#: drains and exits before its replacement starts (capacity N-1 for that slot; for boxes whose cores
#: or memory cannot hold both at once).
ROLLOUT_STRATEGIES = ("surge", "drain_first")
#: When a model's profiles are built: by the background builder while the workers serve, or in each worker's start.
BUILD_MODES = ("background", "at_start")
#: `shadow`: whether a lossy profile must match the served exact answers on live traffic before it serves.
SHADOW_MODES = ("on", "off")
SOURCE_KINDS = ("builtin", "torchscript", "exported", "python")
_PYTHON_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*")


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
    #: State pairs of a stateful model (protocol/state.py); empty for a stateless one.
    state: tuple[StateSpec, ...]
    #: Bounds of the streams of a stateful model (settings/stream_keys.py).
    max_streams: int
    max_streams_per_peer: int | None
    max_state_bytes: int
    stream_idle_s: float
    #: Steps of each sequence the sequence gate walks a stateful model's profiles over.
    sequence_steps: int
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
    #: Input name -> the full shape pick "fastest" times at (None: the validation set's largest group, or the example).
    typical_shape: dict[str, list[int]] | None
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
    audit: AuditConfig
    #: "on": a lossy profile (int8, bf16) serves only after matching the served exact answers in shadow.
    shadow: str
    shadow_rows: int
    shadow_budget: float
    #: Keep a bounded sample of served inputs in the cache as the gate's and the pick's evidence.
    record_inputs: bool
    record_inputs_mb: int


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
        "the model's inputs, in the order its `forward` takes them, each dim fixed, any size (null), a range "
        "`[min, max]` or a range in steps `[min, max, step]`, and the synthetic data the daemon draws for it; "
        "admission checks requests against new ones at once ([more](#inputs))."),
    Key("outputs", Custom(read_outputs, "array of non-empty strings, or null (`[]` = null)"), Applied.ROLLING,
        "names for the model's outputs in order; default: the built-in's names, the keys of a returned dict, else "
        "`output`, `output_1`, ..."),
    Key("state", Custom(read_state, "array of `{input, output, dtype, shape, initial}`, or null (`[]` = null)"),
        Applied.ROLLING,
        "a stateful model's state pairs: the declared input (batch first, every other dim fixed) a stream's state "
        "is fed to, the output that returns the next state, and its initial value (`\"zeros\"` or a `.npy` "
        "file); the daemon keeps each stream's state between its steps ([more](#stateful-models))."),
    *STREAM_KEYS,
    Key("sequence_steps", Integer(200, 1, 100_000), Applied.ROLLING,
        "with `state`: steps of each sequence every profile is checked on against eager, each feeding back its own "
        "state (the validation file's sequences are cut to it) ([more](optimization.md#the-sequence-gate))."),
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
    Key("validation", Custom(read_validation_file, "path (relative to config.json) or null"), Applied.ROLLING,
        "an `.npz` of the inputs every profile is checked on against eager fp32, and for a model with `state` "
        "sequences of them (`seq:` keys); null: seeded random inputs "
        "([more](#calibration-and-validation))."),
    Key("batching",
        Custom(_read_batching, "`{max_batch_size, max_queue_delay_us, preferred_batch_sizes}` or null"),
        Applied.ROLLING,
        "join requests of this model into one forward pass (off when null) ([more](#batching))."),
    Key("tolerance",
        Custom(read_tolerance,
               "`min_cosine` (-1..1), `max_rel_error` (≥ 0 or null), `max_channel_error` (≥ 0 or null), "
               "`max_element_error` (≥ 0 or null), `max_abs_error` (≥ 0 or null), `top1` (bool), "
               "`outputs` (name → limits and `slices`), "
               "`task_check` (`module:function` or null)",
               DEFAULT_TOLERANCE),
        Applied.ROLLING,
        "how close to eager fp32 a profile must stay on the golden (or validation) inputs: the cosine of the worst "
        "sample (each row of the batch, all outputs joined); on each output with at most "
        f"{FEW_VALUES_PER_ROW} values per row (a score, a probability, a box), where a cosine cannot fail, the "
        "largest difference as a fraction of eager's largest magnitude on that output; on each longer one, the "
        "worst element over eager's largest magnitude in its row (`max_element_error`); on each output whose rows "
        "are matrices (a packed detection head, a feature map), each channel's largest difference over eager's "
        "largest magnitude on that channel, and on flat rows each group of columns on its own scale (box pixels "
        "beside scores) (`max_channel_error`; both by default √(10 (1 − min_cosine))); per-output "
        "limits and declared slices; an optional task-level check; the largest absolute difference; and argmax "
        "agreement on every row ([more](#tolerance))."),
    Key("typical_shape",
        Custom(read_typical_shape, "object: input name → full shape (batch first) the inputs accept, or null"),
        Applied.ROLLING,
        "the input size that is served: pick `fastest` times its candidates there; null: at the validation set's "
        "largest shape group, else at the declared example ([more](#typical_shape))."),
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
    Key("audit",
        Custom(read_audit, "`{budget, action}`: `budget` a share of one core in [0, 1] (0 = off), `action` "
               "`fallback` or `report`", {"budget": DEFAULT_AUDIT_BUDGET, "action": "fallback"}),
        Applied.LIVE,
        "the live audit: served answers of a compiled or quantized profile, sampled within `budget` of one core and "
        "at most once a second, re-run on eager fp32 at the lowest CPU priority and judged by `tolerance`; a row "
        "below it makes the model "
        "fall back one step (`fallback`) or is only reported (`report`) ([more](optimization.md#the-live-audit))."),
    Key("shadow", Choice("on", SHADOW_MODES), Applied.ROLLING,
        "`on` (with `build: background`): a lossy profile (int8, bf16, openvino_bf16/int8) serves only after "
        "`shadow_rows` live rows, run on it beside the exact profile that serves, stayed within `tolerance`; one "
        "row outside refuses it for good (recorded in the cache); `off`: it serves once its gate passes "
        "([more](optimization.md#the-shadow))."),
    Key("shadow_rows", Integer(200, 1), Applied.LIVE,
        "live rows the shadow compares before a lossy profile serves (and at least 3 shapes when an input has an "
        "open dim besides the batch)."),
    Key("shadow_budget", Fraction(0.25, 1.0), Applied.LIVE,
        "share of one core the shadow process may spend (at the lowest CPU priority) running sampled requests on "
        "the lossy candidate."),
    Key("record_inputs", Flag(True), Applied.LIVE,
        "keep a bounded sample of the inputs this model served (the newest 16 per input shape, sampled at most 4 "
        "times a second) in the cache, 0600, per spec key: the builder's gate checks profiles on them beside the "
        "validation set and pick `fastest` times at their shape mix; `false` (a box whose inputs must not be kept "
        "on disk) records nothing and removes what was recorded ([more](optimization.md#recorded-inputs))."),
    Key("record_inputs_mb", Integer(DEFAULT_CAP_MB, 1, 1 << 20), Applied.LIVE,
        "cap of the model's recorded inputs (MiB); past it the oldest samples are dropped."),
)
# fmt: on
