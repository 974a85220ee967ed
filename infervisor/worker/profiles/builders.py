"""The profile builders' registry and what a builder gives: one module both build.py and openvino.py register in.

Of the worker it imports only the cache (a packaged build's key) and the calibration set.

`build_profile` (build.py) looks a profile's builder up here; a family of builders with its own
runtime (the OpenVINO profiles) lives in its own module and registers with the same `@builds`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from infervisor.common.accuracy import ACCURACY_WARNING_NOTE
from infervisor.common.profiles import PROFILES
from infervisor.common.verdicts import UNPROVEN, Verdicts, lossy
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.cache import ArtifactCache, file_digest
from infervisor.worker.profiles.calibration import Inputs, load_calibration, random_calibration, random_calibration_id

if TYPE_CHECKING:  # the gate imports the runner and the comparison, which need nothing from here
    from infervisor.worker.profiles.recorded import ServedInputs
    from infervisor.worker.profiles.sequence_gate import SequenceGate


class ProfileError(Exception):
    """The profile cannot be built for this model; the message says why."""


#: How a build note about a damaged cached package begins: a worker that restarts after its build passes these on.
REJECTED_NOTE = "cached package "


@dataclass
class BuildContext:
    """What building a profile needs besides its name."""

    module: Any
    example: Inputs
    specs: tuple[TensorSpec, ...]
    #: sha256 of the model (weights and code); part of every cache key.
    digest: str
    channels_last: bool = False
    cache: ArtifactCache | None = None
    calibration: Path | None = None
    #: Only part of the fastest-pick decision's key: the profiles were checked on it.
    validation: Path | None = None
    #: Batch sizes (rows) the broker joins requests into for this model: the gate checks them too.
    served_batches: tuple[int, ...] = ()
    #: Config `typical_shape` (input name -> full shape): the size pick "fastest" times at (timing_size.py).
    typical_shape: dict[str, list[int]] | None = None
    #: A stateful model's sequence gate: every profile that passes the single-call gate is walked over it too.
    sequences: SequenceGate | None = None
    #: What live traffic proved about this model's profiles (common/verdicts.py): refusals are honoured.
    verdicts: Verdicts | None = None
    #: A lossy profile serves only with a shadow pass in `verdicts` (a serving worker with config `shadow: on`).
    needs_evidence: bool = False
    #: The served inputs the supervisor recorded (recorded.py): the gate checks them, pick "fastest" times their mix.
    served: ServedInputs | None = None

    def evidence_refusal(self, name: str) -> str | None:
        """Why live traffic's verdicts keep `name` from serving (refused, or lossy and not yet shadowed), or None."""
        refusal = self.verdicts.refusal(name) if self.verdicts is not None else None
        if refusal is None and self.needs_evidence and lossy(name):
            if self.verdicts is None or name not in self.verdicts.passed:
                refusal = UNPROVEN
        return refusal


@dataclass
class Built:
    """A built profile: what serves, and what building it did (compiled, loaded from cache, ...)."""

    callable: Callable[..., Any]
    notes: list[str] = field(default_factory=list)


Builder = Callable[[BuildContext], Built]
_BUILDERS: dict[str, Builder] = {}
#: The builder of every declared profile, by name (a test checks the two tables name the same profiles).
BUILDERS: Mapping[str, Builder] = MappingProxyType(_BUILDERS)


def builds(name: str) -> Callable[[Builder], Builder]:
    """Register the decorated function as the one builder of the profile declared as `name`."""
    if name not in PROFILES:
        raise LookupError(f"profile {name!r} has a builder but no declaration in infervisor/common/profiles.py")
    if name in _BUILDERS:
        raise LookupError(f"profile {name!r} has two builders")

    def register(builder: Builder) -> Builder:
        _BUILDERS[name] = builder
        return builder

    return register


def calibration_set(context: BuildContext, notes: list[str]) -> tuple[list[Inputs], str]:
    """The calibration samples (the configured set, or seeded synthetic inputs) and what identifies them in a key."""
    if context.calibration is None:
        notes.append("calibrated on seeded random inputs (no calibration set configured)")
        return random_calibration(context.example, context.specs), random_calibration_id(context.specs)
    digest = file_digest(context.calibration)
    if context.validation is not None and _same_file(context.calibration, context.validation, digest):
        notes.append(
            f"{ACCURACY_WARNING_NOTE}calibration and validation are the same file ({context.validation}): the int8 "
            "scales were fitted on the very samples they are judged on, so the gate's pass says nothing about other "
            "inputs; configure a validation file the calibration did not see"
        )
    return load_calibration(context.calibration, context.specs), digest


def _same_file(calibration: Path, validation: Path, digest: str) -> bool:
    """Whether the two sets are one file (the same path, or the same bytes under two names)."""
    try:
        return calibration.samefile(validation) or file_digest(validation) == digest
    except OSError:
        return False
