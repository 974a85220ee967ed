"""The live fallback's steps: `infervisor fallback`, a repeated canary mismatch and the live audit's finding of a row
below tolerance roll a model down its chain.

infervisor/supervisor/settings/fallback.py decides the chains and keeps what is in force; this module turns a decision
into a readiness-gated rollout of the model's pool (the rollout target, then one worker at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

from infervisor.common import verdicts
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.monitors.findings import Finding
from infervisor.supervisor.settings.fallback import Fallback, FallbackOrigin, Fallbacks
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import RestartReason, SlotState, WorkerSlot

log = structlog.get_logger("supervisor")

#: Who refused a profile, as the recorded verdict says it.
_RECORDED_BY = {FallbackOrigin.AUDIT: "live audit", FallbackOrigin.CANARY: "canary"}
#: A finding's fields that are not figures of the refusal (the verdict has its own time, profile and reason).
_NOT_FIGURES = frozenset({"at", "profile", "served_by_pid", "reason", "failure", "earlier_pids"})


class FallbackControl:
    """Starts the rollouts a fallback or its reset needs, and answers the control commands for them."""

    def __init__(self, serving: ServingConfig, pool: WorkerPool) -> None:
        self.serving = serving
        self.pool = pool
        #: Models moved down their chain: an overlay on config.json that every reload keeps.
        self.fallbacks = Fallbacks()

    def command(self, command: dict[str, Any]) -> dict[str, Any]:
        """`{"cmd": "fallback", "model": M, "reset": bool, "reason": str}`: the control socket's answer."""
        model, reset = command.get("model"), command.get("reset", False)
        if not isinstance(model, str) or type(reset) is not bool:
            return {"ok": False, "error": "fallback needs model (a string) and reset (true or false)"}
        if reset:
            return self.reset(model)
        reason = command.get("reason")
        if reason is not None and not isinstance(reason, str):
            return {"ok": False, "error": "fallback's reason must be a string"}
        return self.fall_back(model, (reason or "operator command")[:200], FallbackOrigin.OPERATOR)

    def for_finding(self, slot: WorkerSlot, finding: Finding) -> bool:
        """A monitor's evidence against the slot's profile moves its model down; False when it cannot.

        The audit's finding says why itself (`reason`: the row, its figures, the tolerance, the input shape);
        a canary's is its mismatch repeated in other processes of the profile.
        """
        said = finding.detail.get("reason")
        if isinstance(said, str):
            reason, origin = said, FallbackOrigin.AUDIT
        else:
            earlier = finding.detail.get("earlier_pids")
            pids = ", ".join(str(p) for p in [*(earlier if isinstance(earlier, list) else []), slot.pid])
            reason, origin = f"{finding.monitor} on {slot.proc.profile} repeated in pids {pids}", FallbackOrigin.CANARY
        self.record_refusal(slot, reason, origin, finding.detail)
        answer = self.fall_back(slot.model.name, reason, origin)
        if not answer["ok"]:
            log.warning("fallback_not_possible", slot=slot.name, reason=reason, why=answer["error"])
        return bool(answer["ok"])

    def record_refusal(self, slot: WorkerSlot, reason: str, origin: FallbackOrigin, detail: dict[str, Any]) -> None:
        """Keep a monitor's refusal of the slot's profile beside the pick, under the worker's spec key: a restart,
        the builder, the fallback chain and an import of the bundle never serve that profile for this spec again.

        Eager is never recorded: it is the reference every other profile is judged against, and the chain's floor.
        """
        profile = slot.proc.profile
        keys = [
            n.removeprefix(verdicts.SPEC_KEY_NOTE)
            for n in slot.proc.build_notes
            if n.startswith(verdicts.SPEC_KEY_NOTE)
        ]
        if not profile or profile == "eager":
            return
        if not keys:
            log.warning("refusal_not_recorded", model=slot.model.name, profile=profile, why="no spec key")
            return
        figures = {k: v for k, v in detail.items() if k not in _NOT_FIGURES}
        measure = detail.get("failure") or "canary: golden outputs moved from the warm-up's"
        verdict = {"by": _RECORDED_BY[origin], "why": reason, "measure": measure, **figures}
        try:
            verdicts.record(resolve_cache_dir(self.serving.current.cache_dir), keys[0], slot.model.name, profile,
                            verdict, True)  # fmt: skip
        except OSError as exc:
            log.error("refusal_not_recorded", model=slot.model.name, profile=profile, why=str(exc))

    def fall_back(self, model: str, reason: str, origin: FallbackOrigin) -> dict[str, Any]:
        """Rebuild a model's workers, rolling, with the chain after the profile they serve now; the answer."""
        refused = self.refusal(model)
        if refused is not None:
            return {"ok": False, "error": refused}
        current = self.serving.current.models[model]
        serving = self.serving_profiles(model)
        if not serving:
            return {"ok": False, "error": f"no worker of {model!r} serves: there is no profile to fall back from"}
        outcome = self.fallbacks.step_down(current, serving, reason, origin)
        if isinstance(outcome, str):
            return {"ok": False, "error": f"{model!r} cannot fall back: {outcome}"}
        return self.roll_chain(
            model, outcome.chain, outcome, f"fallback from {outcome.left}: {reason}", "model_fell_back"
        )

    def reset(self, model: str) -> dict[str, Any]:
        """Forget the refusals recorded for the model (common/verdicts.py) and rebuild a fallen-back model's
        workers, rolling, with the chain config.json gives it; with no fallback in force, its build starts again."""
        refused = self.refusal(model)
        if refused is not None:
            return {"ok": False, "error": refused}
        try:
            cleared = verdicts.clear(resolve_cache_dir(self.serving.current.cache_dir), model)
            # What was recorded of its traffic goes too: the reset starts the model's evidence afresh.
            self.pool.builds.recorder.clear(model)
        except OSError as exc:
            return {"ok": False, "error": f"the recorded verdicts of {model!r} could not be removed: {exc}"}
        outcome = self.fallbacks.reset(model)
        if isinstance(outcome, str) and cleared:
            log.warning("verdicts_cleared", model=model, refusals=cleared)
            why = "recorded refusals cleared by the operator"
            self.pool.builds.restart(model, why)
            # Workers serving a later profile of the chain because of a refusal start again without it.
            queued = self.pool.restart(model, why, RestartReason.OPERATOR)
            return {"ok": True, "model": model, "refusals_cleared": cleared, "queued": queued}
        if isinstance(outcome, str):
            return {"ok": False, "error": outcome}
        if cleared:
            log.warning("verdicts_cleared", model=model, refusals=cleared)
        # `from` is the profile the reset leaves: what the workers serve now under the fallback's chain.
        serving = [p for p in self.serving_profiles(model) if p in outcome.chain]
        leaving = min(serving, key=outcome.chain.index) if serving else outcome.chain[0]
        answer = self.roll_chain(
            model, outcome.configured, outcome, "fallback reset by the operator", "fallback_reset_started", leaving
        )
        return {**answer, "refusals_cleared": cleared}

    def serving_profiles(self, model: str) -> list[str]:
        """The profile of each serving member of the model."""
        members = self.pool.roster.members[model]
        return [s.proc.profile for s in members if s.state is SlotState.SERVING and s.proc.profile]

    def refusal(self, model: str) -> str | None:
        """Why the model's chain cannot be changed now, or None."""
        if model not in self.pool.roster.members:
            return f"no model {model[:128]!r}; serving {sorted(self.pool.roster.members)}"
        if self.serving.target(model) is not None:
            return f"{model!r} is rolling out a config; fall back once `infervisor status` shows it applied"
        return None

    def roll_chain(
        self, model: str, chain: tuple[str, ...], fallback: Fallback, why: str, event: str, left: str | None = None
    ) -> dict[str, Any]:
        """Make `chain` the model's rollout target and replace its workers one at a time (readiness-gated).

        `left` is the profile the move leaves (default: the one the fallback left).
        """
        left = fallback.left if left is None else left
        current = self.serving.current.models[model]
        self.serving.begin_rollout(dataclasses.replace(current, profiles=chain))
        queued = self.pool.restart(model, why, RestartReason.CONFIG)
        log.warning(
            event, model=model, left=left, profiles=list(chain), configured=list(fallback.configured),
            origin=fallback.origin.value, reason=fallback.reason, workers=queued,
        )  # fmt: skip
        return {"ok": True, "model": model, "profiles": list(chain), "from": left, "queued": queued}

    def reconcile(self) -> None:
        """Follow the rollouts a fallback started (a finished reset ends it, a rolled-back one is noted)."""
        self.fallbacks.reconcile(self.serving)
