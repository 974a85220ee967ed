"""A model's `audit` key: how much CPU the live audit may spend re-running served answers on eager fp32, and what a
row below tolerance does (supervisor/lifecycle/audit_runner.py samples and reruns, supervisor/monitors/audit.py
judges)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from infervisor.supervisor.settings.config_keys import ReadContext


class AuditAction(enum.Enum):
    """What the daemon does about a served row the audit finds below the model's tolerance."""

    FALLBACK = "fallback"  # the model falls back one step of its chain (rolling replacement), the finding says why
    REPORT = "report"  # status and metrics only


#: Default share of one core the audit may use: 2%, small enough to stay within a few percent of serving's own time.
DEFAULT_AUDIT_BUDGET = 0.02


@dataclass(frozen=True)
class AuditConfig:
    """The live audit of one model: its CPU budget (share of one core; 0 turns it off) and its action."""

    budget: float = DEFAULT_AUDIT_BUDGET
    action: AuditAction = AuditAction.FALLBACK

    def to_config(self) -> dict[str, object]:
        """As config.json has it."""
        return {"budget": self.budget, "action": self.action.value}


def read_audit(ctx: ReadContext, raw: Any, path: str) -> AuditConfig:
    """`{"budget": 0.02, "action": "fallback"}`; absent keys take their defaults, null is the default audit."""
    r = ctx.fields
    if raw is None:
        return AuditConfig()
    if not isinstance(raw, dict):
        r.fail(path, 'must be an object like {"budget": 0.02, "action": "fallback"}')
        return AuditConfig()
    r.check_keys(raw, path, {"budget", "action"})
    budget = r.number(raw, "budget", path, DEFAULT_AUDIT_BUDGET, 0.0)
    if budget > 1.0:
        r.fail(f"{path}.budget", f"is a share of one core: at most 1, got {budget}")
        budget = DEFAULT_AUDIT_BUDGET
    action = raw.get("action", AuditAction.FALLBACK.value)
    choices = [a.value for a in AuditAction]
    if action not in choices:
        r.fail(f"{path}.action", f"must be one of {', '.join(choices)}, got {action!r}")
        action = AuditAction.FALLBACK.value
    return AuditConfig(budget, AuditAction(action))
