"""Serving a compiled profile only where it answers as eager does: per input shape, once checked, else eager.

A compiled program can be right at the sizes it was checked at and give another output shape at
others (AOTInductor packages do not check the guards their export recorded), and the daemon's own
dispatch refuses some shapes (dispatch.ShapeNotServed). Neither may reach a client: the first time a
profile meets an input shape, its output shapes are compared with eager's on the same inputs; a
difference, or a refusal, serves that request (and that shape from then on) with eager instead. A
profile that misses on `give_up_after` shapes falls back to eager for good and says so: the canary
then fails, so the supervisor moves the model down its chain where status shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch

from infervisor.worker.profiles.dispatch import ShapeNotServed

log = structlog.get_logger("worker")

#: Input shapes whose verdict is kept; past this many, a new shape is checked on each call (bounded memory).
_KEPT_SHAPES = 4096
#: Shapes a profile may miss before it falls back for good.
GIVE_UP_AFTER = 8

Shapes = tuple[tuple[int, ...], ...]


def output_shapes(result: Any) -> Any:
    """The shapes of a model's result, in its structure (tensor, tuple, list, dict)."""
    if isinstance(result, torch.Tensor):
        return tuple(result.shape)
    if isinstance(result, (tuple, list)):
        return tuple(output_shapes(r) for r in result)
    if isinstance(result, Mapping):
        return tuple((str(k), output_shapes(v)) for k, v in result.items())
    return type(result).__name__


class Covered:
    """`primary` where it gives eager's output shapes, `fallback` (eager) elsewhere."""

    def __init__(
        self,
        primary: Callable[..., Any],
        fallback: Callable[..., Any],
        profile: str,
        give_up_after: int = GIVE_UP_AFTER,
        check_shapes: bool = True,
    ) -> None:
        """`check_shapes` False: new input shapes are trusted (a model whose only open dim is the batch, whose
        sizes the gate checked); only the daemon's own refusals go to `fallback`."""
        self.primary = primary
        self.fallback = fallback
        self.profile = profile
        self.give_up_after = give_up_after
        self.check_shapes = check_shapes
        #: Input shapes -> whether the profile serves them (checked against eager once).
        self.verdicts: dict[Shapes, bool] = {}
        self.misses = 0
        self.gave_up = False
        #: Why the profile fell back for good ("" while it serves).
        self.reason = ""

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self.gave_up:
            return self.fallback(*inputs)
        key: Shapes = tuple(tuple(t.shape) for t in inputs)
        verdict = self.verdicts.get(key)
        if verdict is False:
            return self.fallback(*inputs)
        try:
            result = self.primary(*inputs)
        except ShapeNotServed as exc:
            self._miss(key, str(exc))
            return self.fallback(*inputs)
        if verdict is None and self.check_shapes:
            expected = self.fallback(*inputs)
            got, want = output_shapes(result), output_shapes(expected)
            if got != want:
                self._miss(key, f"it gives output shapes {got} where eager gives {want}")
                return expected
            if len(self.verdicts) < _KEPT_SHAPES:
                self.verdicts[key] = True
        return result

    def _miss(self, key: Shapes, why: str) -> None:
        if len(self.verdicts) < _KEPT_SHAPES:
            self.verdicts[key] = False
        self.misses += 1
        inputs = [list(shape) for shape in key]
        log.warning("profile_shape_fallback", profile=self.profile, inputs=inputs, reason=why, served_by="eager")
        if self.misses >= self.give_up_after:
            self.gave_up = True
            self.reason = (
                f"{self.profile} fell back to eager in this worker: it did not answer {self.misses} input shapes "
                f"as eager does (last at {inputs}: {why})"
            )
            log.error("profile_fell_back", profile=self.profile, reason=self.reason)


class Reloaded:
    """A module loaded again only when first called: the eager fallback of a worker that freed its eager module."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self.load = load
        self.module: Any = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self.module is None:
            log.warning("eager_fallback_loading", reason="a profile did not serve an input shape")
            self.module = self.load()
        return self.module(*inputs)
