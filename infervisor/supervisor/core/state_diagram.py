"""docs/architecture.md's slot state diagram, rendered from the transition table in workers/slot.py.

`python -m infervisor.supervisor.core.state_diagram` exits 1 when the diagram differs from the table;
`--write` rewrites it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from infervisor.supervisor.settings.config_docs import check_or_write
from infervisor.supervisor.workers.slot import TRANSITIONS, SlotState

DOCS = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"
BEGIN = "<!-- generated: slot states (python -m infervisor.supervisor.core.state_diagram --write) -->\n"
END = "<!-- end generated -->"


def diagram() -> str:
    """The transition table as a Mermaid state diagram, one arrow per allowed move, labelled with its cause."""
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {SlotState.STOPPED.name}"]
    for source, moves in TRANSITIONS.items():
        lines += [f"    {source.name} --> {target.name}: {why}" for target, why in moves.items()]
    return "\n".join([*lines, "```"]) + "\n"


def render(text: str) -> str:
    """`text` with its generated block holding the current diagram; ValueError when the block is missing."""
    start = text.find(BEGIN)
    end = text.find(END, start)
    if start < 0 or end < 0:
        raise ValueError(f"{DOCS.name} has no generated slot-states block")
    return text[: start + len(BEGIN)] + diagram() + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    """Check docs/architecture.md's diagram against the table, or rewrite it with --write."""
    prog = "python -m infervisor.supervisor.core.state_diagram"
    return check_or_write(DOCS, render, prog, "the slot state diagram differs from TRANSITIONS", argv)


if __name__ == "__main__":
    sys.exit(main())
