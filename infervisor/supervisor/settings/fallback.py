"""The fallback path that is always there: a model moved down its validated chain, live, and back (by the
operator, a repeated canary mismatch, or the live audit).

A fallback is an overlay on config.json: the model's workers are rebuilt with the chain that
starts after the profile they serve now, and every later reload applies the same overlay, so an
unrelated edit does not undo it. Editing the model's `profiles` in config.json ends it (the
operator chose a chain), as does `infervisor fallback --reset`. fallback_control.py starts the rollouts;
this module only decides the chains and keeps what is in force and why.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig

log = structlog.get_logger("supervisor")


class FallbackOrigin(enum.Enum):
    """Who moved the model down its chain."""

    OPERATOR = "operator"  # `infervisor fallback --model M`
    CANARY = "canary"  # a canary mismatch that repeated on another process of the same profile
    AUDIT = "audit"  # the live audit found a served row below tolerance against eager fp32


class FallbackState(enum.Enum):
    """Where a fallback stands, from the serving config (not from what was asked)."""

    ROLLING = "rolling"  # the model's workers are being rebuilt with the shorter chain
    IN_FORCE = "in force"  # every worker is built with it
    RESETTING = "resetting"  # `--reset`: the workers are being rebuilt with the configured chain


@dataclass(frozen=True)
class Fallback:
    """One model's fallback: the chain config.json gives, the one its workers are built with, and why."""

    configured: tuple[str, ...]
    chain: tuple[str, ...]
    #: The profile it moved away from (the one the workers served when it was asked for).
    left: str
    reason: str
    origin: FallbackOrigin
    #: Wall-clock seconds when it was asked for.
    since: float
    resetting: bool = False


def chain_below(chain: Sequence[str], serving: Sequence[str]) -> tuple[str, tuple[str, ...]] | str:
    """The profile to leave and the chain after it, or why there is nothing below.

    Workers of one model may serve different profiles (a fastest pick per process): the one
    earliest in the chain is left, so no worker keeps the profile being fallen back from. Eager is
    the end of every chain: a chain without it falls back to it last.
    """
    placed = [p for p in serving if p in chain]
    if not placed:
        served = ", ".join(sorted(set(serving))) or "nothing"
        return f"its workers serve {served}, the last resort below its chain {list(chain)}: nothing is below it"
    left = min(placed, key=chain.index)
    rest = tuple(chain[chain.index(left) + 1 :])
    if not rest and left != REFERENCE_PROFILE:
        rest = (REFERENCE_PROFILE,)
    if not rest:
        return f"it serves {left}, the end of its chain {list(chain)}: nothing is below it"
    return left, rest


class Fallbacks:
    """The fallbacks in force (or on their way), per model, and the last word on ones that did not take."""

    def __init__(self) -> None:
        self.active: dict[str, Fallback] = {}
        #: Per model, why its last fallback (or reset) did not take, or what ended it.
        self.notes: dict[str, str] = {}

    def overlay(self, config: Config) -> Config:
        """config.json with each fallback's chain in force (not the ones `ended` by this config, nor resets)."""
        models = dict(config.models)
        for name, fallback in self.active.items():
            model = models.get(name)
            if model is not None and model.profiles == fallback.configured and not fallback.resetting:
                models[name] = dataclasses.replace(model, profiles=fallback.chain)
        return dataclasses.replace(config, models=models)

    def end_stale(self, config: Config) -> None:
        """config.json as read (before the overlay), now served, ends each fallback whose model or chain it changed."""
        for name, fallback in list(self.active.items()):
            model = config.models.get(name)
            if model is None or model.profiles != fallback.configured:
                del self.active[name]
                why = "the model left the config" if model is None else "config.json now gives it another chain"
                self.notes[name] = f"fallback to {list(fallback.chain)} ended: {why}"
                log.info("fallback_cleared", model=name, reason=why)

    def step_down(
        self, current: ModelConfig, serving: Sequence[str], reason: str, origin: FallbackOrigin
    ) -> Fallback | str:
        """Record the model one step below what its workers serve; the fallback, or why there is none."""
        below = chain_below(current.profiles, serving)
        if isinstance(below, str):
            return below
        left, chain = below
        earlier = self.active.get(current.name)
        configured = earlier.configured if earlier is not None else current.profiles
        fallback = Fallback(configured, chain, left, reason, origin, time.time())
        self.active[current.name] = fallback
        self.notes.pop(current.name, None)
        return fallback

    def reset(self, name: str) -> Fallback | str:
        """Mark the model's fallback as being undone; the fallback (with its configured chain), or why not."""
        fallback = self.active.get(name)
        if fallback is None or fallback.resetting:
            return f"no fallback is in force for {name!r}" if fallback is None else f"{name!r} is already resetting"
        self.active[name] = dataclasses.replace(fallback, resetting=True)
        return fallback

    def reconcile(self, serving: ServingConfig) -> None:
        """Follow the rollouts: a reset that finished ends its fallback; a rollout that was rolled back is noted."""
        for name, fallback in list(self.active.items()):
            model = serving.model(name)
            if model is None or serving.target(name) is not None:
                continue  # gone (overlay drops it at the next reload) or still rolling
            error = serving.rollout_error(name)
            if fallback.resetting and model.profiles == fallback.configured:
                del self.active[name]
                log.info("fallback_reset", model=name, profiles=list(model.profiles))
            elif fallback.resetting:
                self.active[name] = dataclasses.replace(fallback, resetting=False)
                self.notes[name] = f"reset to {list(fallback.configured)} rolled back: {error or '?'}"
                log.error("fallback_reset_failed", model=name, error=error)
            elif model.profiles != fallback.chain:
                del self.active[name]
                self.notes[name] = f"fallback to {list(fallback.chain)} rolled back: {error or '?'}"
                log.error("fallback_failed", model=name, error=error)

    def status(self, name: str, current: ModelConfig | None) -> dict[str, object] | None:
        """The model's `fallback` entry in status, or None when its configured chain serves and nothing is noted."""
        fallback = self.active.get(name)
        if fallback is None:
            note = self.notes.get(name)
            return {"state": None, "note": note} if note else None
        if fallback.resetting:
            state = FallbackState.RESETTING
        elif current is not None and current.profiles == fallback.chain:
            state = FallbackState.IN_FORCE
        else:
            state = FallbackState.ROLLING
        return {
            "state": state.value,
            "profiles": list(fallback.chain),
            "configured": list(fallback.configured),
            "from": fallback.left,
            "reason": fallback.reason,
            "origin": fallback.origin.value,
            "since": round(fallback.since, 3),
            "note": self.notes.get(name),
        }
