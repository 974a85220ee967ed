"""How long each kind of child waits to be started again after ending unasked: one table, one function.

Workers, builders, audit and shadow processes, the OIP gateway and the warm template each doubled their own
wait; here each kind is one row, so changing a kind's wait is one line. What else an exit means (a worker's
state, requests and `max_restarts`, a builder's restart at once and the profile it gives up, an audit or shadow
process's hang and stuck limits, when a shadow is given up, when a gateway's run starts its count afresh) is
lifecycle/exit_decision.py's, which reads these waits through `retry_in`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ChildKind(enum.Enum):
    """The kinds of child process the supervisor starts again after they end."""

    WORKER = "worker"
    BUILDER = "builder"
    AUDIT = "audit"
    SHADOW = "shadow"
    GATEWAY = "gateway"
    TEMPLATE = "template"


@dataclass(frozen=True)
class RetryPolicy:
    """The wait before the next start: `first_s` after one end, doubled per further end in a row, up to `max_s`."""

    first_s: float
    max_s: float


#: Each kind's policy. A worker's first crash while serving respawns at once, and so does the end of one that answered
#: a request (exit_decision.py): these waits start from the second end of one that answered none, or from the first
#: of one that never got ready. A background builder that crashed on a profile starts again at once: the profile it
#: crashed on is what is given up (exit_decision.py), and the build's attempts are capped by its chain. An audit or
#: shadow process runs at idle priority
#: beside serving, so a broken one is retried slowly; the template's start imports torch (seconds of CPU), so a
#: template that keeps failing must not cost the box that every few seconds.
POLICIES: dict[ChildKind, RetryPolicy] = {
    ChildKind.WORKER: RetryPolicy(1.0, 30.0),
    ChildKind.BUILDER: RetryPolicy(0.0, 0.0),
    ChildKind.AUDIT: RetryPolicy(1.0, 300.0),
    ChildKind.SHADOW: RetryPolicy(1.0, 300.0),
    ChildKind.GATEWAY: RetryPolicy(1.0, 30.0),
    ChildKind.TEMPLATE: RetryPolicy(5.0, 300.0),
}


def retry_in(kind: ChildKind, ends_in_row: int) -> float:
    """Seconds to wait before starting a child of `kind` that has ended `ends_in_row` times in a row (1: the first)."""
    policy = POLICIES[kind]
    return float(min(policy.max_s, policy.first_s * 2 ** max(0, ends_in_row - 1)))
