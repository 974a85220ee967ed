"""The key tables of docs/configuration.md, rendered from the declarations in infervisor/supervisor/settings/config.py.

`python -m infervisor.supervisor.settings.config_docs` exits 1 when the file's tables differ from the declarations;
`--write` rewrites them. Everything outside the marked blocks is left as written.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from infervisor.supervisor.settings.config import TOP_KEYS
from infervisor.supervisor.settings.config_keys import Applied, Key
from infervisor.supervisor.settings.model_entry import MODEL_KEYS

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
COMMAND = "python -m infervisor.supervisor.settings.config_docs --write"


@dataclass(frozen=True)
class _Level:
    """One level of config.json: its keys, and for each rule its label in the key table and what it does."""

    title: str
    keys: tuple[Key, ...]
    rules: dict[Applied, tuple[str, str]]


_TOP = _Level(
    "top level",
    TOP_KEYS,
    {
        Applied.LIVE: ("live", "at once."),
        Applied.ROLLING: (
            "rolling, every model",
            "workers get them at launch: rolling restart of every model. The supervisor's side uses the new values "
            "at once.",
        ),
        Applied.DAEMON_RESTART: (
            "daemon restart",
            "bound at start: kept at the running value, the rest of the file is applied; log event "
            "`config_needs_daemon_restart` and `config.last_diff.needs_daemon_restart` list them on every reload "
            "until the daemon restarts.",
        ),
        Applied.PER_MODEL: (
            "per model",
            "a model added or removed: see the table below; the keys of a kept model follow the model-entry rows.",
        ),
    },
)
_MODEL = _Level(
    "model entry",
    MODEL_KEYS,
    {
        Applied.LIVE: (
            "live",
            "at once, for the model's workers that the same change does not restart (those get the new values with "
            "their successor).",
        ),
        Applied.ROLLING: ("rolling", "rolling restart of that model."),
        Applied.SCALED: (
            "scaled",
            "only the difference: new workers start at once (not rolling), surplus ones (the last slots) drain and "
            "exit; the others are untouched.",
        ),
    },
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(*cells: str) -> str:
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def key_table(level: _Level) -> str:
    """A level's keys in declaration order: name, default, allowed values, how a change applies, meaning."""
    rows = [_row("key", "default", "allowed", "applied", "meaning"), "|---|---|---|---|---|"]
    for key in level.keys:
        label = level.rules[key.applied][0]
        rows.append(_row(f"`{key.name}`", key.value.default_text(), key.value.allowed(), label, key.doc))
    return "\n".join(rows)


def applied_table() -> str:
    """Per level and rule, the keys that follow it and what a change of one does."""
    rows = [_row("level", "applied", "keys", "how a change is applied"), "|---|---|---|---|"]
    for level in (_TOP, _MODEL):
        for applied, (label, how) in level.rules.items():
            names = ", ".join(f"`{key.name}`" for key in level.keys if key.applied is applied)
            rows.append(_row(level.title, label, names, how))
    return "\n".join(rows)


def blocks() -> dict[str, str]:
    """The generated blocks of docs/configuration.md by marker name."""
    return {"top-level keys": key_table(_TOP), "model keys": key_table(_MODEL), "applied": applied_table()}


#: A generated block: its opening marker line, the lines it holds (none at first), its closing marker.
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z -]+?) \(.*?\) -->\n)(?:.*?\n)??(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """`text` with each generated block replaced by what the declarations render; a missing block is an error."""
    wanted = blocks()
    found = {match["name"] for match in _BLOCK.finditer(text)}
    if found != set(wanted):
        raise ValueError(f"generated blocks found {sorted(found)}, expected {sorted(wanted)}")
    return _BLOCK.sub(lambda m: m.group(1) + wanted[m["name"]] + "\n" + m.group(3), text)


def check_or_write(
    docs: Path, render: Callable[[str], str], prog: str, stale: str, argv: Sequence[str] | None = None
) -> int:
    """A generated-docs command: exit 1 saying `stale` when `docs` differs from what `render` makes of it;
    `--write` rewrites it instead."""
    parser = argparse.ArgumentParser(prog=prog, description=f"Check {docs.name}'s generated blocks, or rewrite them.")
    parser.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    args = parser.parse_args(argv)
    text = docs.read_text()
    wanted = render(text)
    if args.write:
        docs.write_text(wanted)
    elif wanted != text:
        print(f"{docs}: {stale}; run `python -m {prog.removeprefix('python -m ')} --write`", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Check docs/configuration.md against the declarations, or rewrite its generated blocks with --write."""
    prog = "python -m infervisor.supervisor.settings.config_docs"
    differ = "the key tables differ from infervisor/supervisor/settings/config.py"
    return check_or_write(DOCS, render, prog, differ, argv)


if __name__ == "__main__":
    sys.exit(main())
