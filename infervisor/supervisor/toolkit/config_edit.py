"""Writes a model's changed keys into config.json text in place, so the rest stays as its author wrote it.

`optimize` writes a chain and a layout into a config a person keeps by hand: re-serializing the whole file put every
JSON token on its own line and showed a diff of the whole file. Here only the values that change are replaced (a new
key goes in before the entry's first one, with its indentation), each on one line, and the diff has no context lines:
what it shows is what changed.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


@dataclass(frozen=True)
class _Member:
    """One `"key": value` of a JSON object: where its key starts and its value's span in the text."""

    key: str
    key_start: int
    value_start: int
    value_end: int


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


def _expect(text: str, pos: int, char: str) -> None:
    if pos >= len(text) or text[pos] != char:
        raise ValueError(f"config.json: expected {char!r} at character {pos}")


def _members(text: str, start: int) -> list[_Member]:
    """The members of the JSON object whose `{` is at `start`, in the order written."""
    _expect(text, start, "{")
    pos = _skip_space(text, start + 1)
    found: list[_Member] = []
    if text[pos : pos + 1] == "}":
        return found
    while True:
        _expect(text, pos, '"')
        key, after_key = json.decoder.scanstring(text, pos + 1)  # type: ignore[attr-defined]  # untyped in stubs
        colon = _skip_space(text, after_key)
        _expect(text, colon, ":")
        value_start = _skip_space(text, colon + 1)
        _, value_end = _DECODER.raw_decode(text, value_start)
        found.append(_Member(key, pos, value_start, value_end))
        pos = _skip_space(text, value_end)
        if text[pos : pos + 1] == "}":
            return found
        _expect(text, pos, ",")
        pos = _skip_space(text, pos + 1)


def _member(members: list[_Member], key: str, where: str) -> _Member:
    for member in members:
        if member.key == key:
            return member
    raise ValueError(f"config.json has no {where}")


def edit_model(text: str, model: str, changes: dict[str, Any]) -> str:
    """`text` with model `model`'s entry given `changes`; every other character as it was."""
    models = _member(_members(text, _skip_space(text, 0)), "models", '"models"')
    entry_start = _member(_members(text, models.value_start), model, f"model {model!r}").value_start
    entry = _members(text, entry_start)
    edits: list[tuple[int, int, str]] = []
    added: list[str] = []
    for key, value in changes.items():
        written = json.dumps(value)
        present = [m for m in entry if m.key == key]
        if not present:
            added.append(f"{json.dumps(key)}: {written}")
        elif json.loads(text[present[0].value_start : present[0].value_end]) != value:
            edits.append((present[0].value_start, present[0].value_end, written))
    if added and entry:
        first = entry[0]
        indent = text[_indent_start(text, first.key_start) : first.key_start] or " "
        edits.append((first.key_start, first.key_start, "".join(f"{line},{indent}" for line in added)))
    elif added:
        edits.append((entry_start + 1, entry_start + 1, ", ".join(added)))
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _indent_start(text: str, pos: int) -> int:
    """Where the run of whitespace that ends at `pos` begins."""
    while pos > 0 and text[pos - 1] in _SPACE:
        pos -= 1
    return pos


def rewrite(text: str, model: str, changes: dict[str, Any]) -> tuple[str, str]:
    """config.json text with the model entry updated in place, and a diff of only the lines that changed."""
    new = edit_model(text, model, changes)
    diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), "config.json", "config.json", n=0))
    return new, diff
