"""What the supervisor hands a new worker process: its model, cores and link (JSON, no pickle)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import TensorSpec

#: How a worker chooses among the profiles of its chain that meet the tolerance.
PICK_MODES = ("first", "fastest")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a built-in name, a TorchScript file or an ExportedProgram (.pt2)."""

    kind: str  # "builtin" | "torchscript" | "exported" | "python" (name = "module:callable")
    name: str | None = None
    #: The model file (torchscript, exported).
    path: str | None = None
    #: For "python": the config's directory, searched for the module after PYTHONPATH and site-packages.
    search_dir: str | None = None


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a worker needs before it imports torch."""

    worker_id: str
    model: str
    #: The worker's end of its link to the supervisor (protocol.worker_link), inherited at exec.
    link_fd: int
    source: ModelSource
    inputs: tuple[TensorSpec, ...]
    output_names: tuple[str, ...] | None
    cpus: tuple[int, ...]
    threads: int
    warmup_iterations: int = 3
    heartbeat_interval_ms: int = 500
    heartbeat_liveness: int = 10
    stats_interval_ms: int = 2000
    max_frame_bytes: int = 256 * 1024 * 1024
    max_memory_mb: int | None = None
    #: The chain of profile names, each declared in infervisor/common/profiles.py (config validation checks them).
    profiles: tuple[str, ...] = ("eager",)
    #: first: the first profile of the chain that passes serves; fastest: every one is tried and timed.
    pick: str = "first"
    channels_last: bool = False
    #: Where compiled packages (and the fastest-pick decisions) are kept between restarts.
    cache_dir: str | None = None
    #: An .npz of calibration inputs for int8_static (random inputs when None).
    calibration: str | None = None
    #: An .npz of inputs every profile is checked on against eager (seeded random inputs when None).
    validation: str | None = None
    #: min_cosine, max_abs_error (or None), top1: how close to eager a profile must stay.
    tolerance: dict[str, Any] = field(default_factory=dict)
    #: How this model's recent workers ended: `{"pid", "how", "signal" (or null), "killed_by_supervisor"}`, so
    #: a worker tells a profile that crashed its predecessor from one the supervisor stopped (profiles/attempts.py).
    recent_exits: list[dict[str, Any]] = field(default_factory=list)
    #: The supervisor's pid: a worker whose parent is another process by the time it asked to die with
    #: its parent (the supervisor died during its start-up) exits at once instead of living on orphaned.
    supervisor_pid: int | None = None
    #: Config `socket_group`'s gid: the worker reads shared-memory inputs of that group that it may read.
    client_gid: int | None = None
    #: The supervisor's limit on one profile's build (config compile_timeout_s): overruns of a lower one do not count.
    compile_timeout_s: float | None = None
    #: `infervisor build`: build and check every packaged profile of the chain, report each, then exit without serving.
    build_only: bool = False
    #: Serve first: install only what needs no build (a cached package, eager, bf16); what is not built yet is
    #: refused and left to the background builder, which never makes this worker wait.
    ready_only: bool = False
    #: Config `shadow: on` (with `build: background`): a lossy profile (int8, bf16) serves only once it passed the
    #: shadow on live traffic (common/verdicts.py); the builder and the shadow process itself are not held to it.
    shadow: bool = False
    #: The background builder: lowest CPU priority (SCHED_IDLE, else nice 19) before torch is imported.
    background: bool = False
    #: With batching, the batch sizes (rows) the broker will join requests into: the accuracy gate checks them.
    served_batches: list[int] = field(default_factory=list)
    #: A stateful model's state pairs (protocol/state.py): what the sequence gate feeds back step by step.
    state: tuple[StateSpec, ...] = ()
    #: Config `typical_shape`: input name -> the full shape pick "fastest" times at (None: the validation set's
    #: largest shape group, else the declared example).
    typical_shape: dict[str, list[int]] | None = None
    #: Steps of each sequence the sequence gate walks (config `sequence_steps`).
    sequence_steps: int = 200
    #: Config `record_inputs_mb` when `record_inputs` is on: the gate and the fastest pick read the served inputs
    #: the supervisor recorded in the cache (common/recorded_inputs.py) up to this cap; 0: none are read.
    recorded_inputs_mb: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """Serialise for the worker's command line."""
        raw = asdict(self)
        raw["state"] = [pair.to_dict() for pair in self.state]
        return json.dumps(raw)

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        """Parse what to_json wrote; raises ValueError/TypeError/KeyError on anything else."""
        raw = json.loads(text)
        raw["source"] = ModelSource(**raw["source"])
        raw["inputs"] = tuple(TensorSpec.from_dict(s) for s in raw["inputs"])
        raw["output_names"] = tuple(raw["output_names"]) if raw.get("output_names") is not None else None
        raw["cpus"] = tuple(raw["cpus"])
        raw["profiles"] = tuple(raw.get("profiles", ("eager",)))
        raw["state"] = tuple(StateSpec.from_dict(pair) for pair in raw.get("state", ()))
        return cls(**raw)
