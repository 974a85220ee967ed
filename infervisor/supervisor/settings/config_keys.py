"""Config keys declared once: how each is read, its default, what it allows, how a change applies, what it means.

infervisor/supervisor/settings/config.py holds the two tables of `Key`s; the parser (`read_object`), the reload diff
(config_diff.py) and the key tables of docs/configuration.md (config_docs.py) are all derived from them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, get_type_hints

from infervisor.supervisor.settings.fields import INTEGER_LIMIT, FieldReader, join_path


class Applied(Enum):
    """How the running daemon takes a change of a key (docs/configuration.md, "How a change is applied")."""

    #: Adopted at once; no process is restarted for it.
    LIVE = "live"
    #: Workers are launched with it: a rolling restart of every model (top-level key) or of that model (model key).
    ROLLING = "rolling"
    #: Bound into sockets at start (top level only): the running value stays until the daemon restarts.
    DAEMON_RESTART = "daemon restart"
    #: `workers`: only the difference starts or drains.
    SCALED = "scaled"
    #: `models`: entries are added or removed; the keys of a kept entry follow their own rules.
    PER_MODEL = "per model"


@dataclass(frozen=True)
class ReadContext:
    """What a reader may use besides its own value: where problems go, the config's folder, the keys read before."""

    fields: FieldReader
    #: Relative paths (model files, data files, certificates) resolve against config.json's folder.
    base: Path
    #: The values of the same object's keys declared above the one being read, by name.
    earlier: dict[str, Any]


class Value(Protocol):
    """How a key's JSON value is read, and what the docs say of its default and of the values it allows."""

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> object:
        """The typed value of `obj[key]`, or the default; a bad value is reported to ctx.fields."""
        ...

    def default_text(self) -> str:
        """The docs' default column."""
        ...

    def allowed(self) -> str:
        """The docs' allowed column."""
        ...

    def value_type(self) -> object:
        """The annotation the config dataclass field must have (a test compares them)."""
        ...


def _json(value: object) -> str:
    """A JSON value as the docs show it: in backticks, a float without a trailing `.0`."""
    return f"`{format(value, 'g') if isinstance(value, float) else json.dumps(value)}`"


def _bound(number: int) -> str:
    """A large power of two as 2^n (2^40 reads better than 1099511627776)."""
    return f"2^{number.bit_length() - 1}" if number >= 2**20 and number & (number - 1) == 0 else str(number)


@dataclass(frozen=True)
class Integer:
    """An integer (booleans and floats refused) in [low, high]; a `None` default makes null or absent mean off."""

    default: int | None
    low: int
    high: int = INTEGER_LIMIT
    #: The problem text, where the bounds alone would not say what the value means.
    why: str | None = None

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> int | None:
        if self.default is None and obj.get(key) is None:
            return None
        fallback = self.low if self.default is None else self.default
        return ctx.fields.integer(obj, key, path, fallback, self.low, self.high, self.why)

    def default_text(self) -> str:
        return _json(self.default)

    def allowed(self) -> str:
        span = f"≥ {self.low}" if self.high == INTEGER_LIMIT else f"{_bound(self.low)}..{_bound(self.high)}"
        return f"integer {span}" + (" or null" if self.default is None else "")

    def value_type(self) -> object:
        return int if self.default is not None else int | None


@dataclass(frozen=True)
class Number:
    """A finite integer or float ≥ low (booleans refused), read as a float; a `None` default makes null mean off."""

    default: float | None
    low: float

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> float | None:
        if self.default is None:
            return ctx.fields.optional_number(obj, key, path, self.low)
        return ctx.fields.number(obj, key, path, self.default, self.low)

    def default_text(self) -> str:
        return _json(self.default)

    def allowed(self) -> str:
        return f"number ≥ {self.low:g}" + (" or null" if self.default is None else "")

    def value_type(self) -> object:
        return float if self.default is not None else float | None


@dataclass(frozen=True)
class Fraction:
    """A number in [0, high]."""

    default: float
    high: float

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> float:
        return ctx.fields.fraction(obj, key, path, self.default, self.high)

    def default_text(self) -> str:
        return _json(self.default)

    def allowed(self) -> str:
        return f"number 0..{self.high:g}"

    def value_type(self) -> object:
        return float


@dataclass(frozen=True)
class Flag:
    """true or false."""

    default: bool

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> bool:
        return ctx.fields.boolean(obj, key, path, self.default)

    def default_text(self) -> str:
        return _json(self.default)

    def allowed(self) -> str:
        return "bool"

    def value_type(self) -> object:
        return bool


@dataclass(frozen=True)
class Choice:
    """One of a fixed set of strings, matched exactly."""

    default: str
    choices: tuple[str, ...]

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> str:
        value = obj.get(key, self.default)
        if value not in self.choices:
            ctx.fields.fail(join_path(path, key), f"must be one of {', '.join(self.choices)}, got {value!r}")
            return self.default
        return str(value)

    def default_text(self) -> str:
        return _json(self.default)

    def allowed(self) -> str:
        return ", ".join(f"`{choice}`" for choice in self.choices)

    def value_type(self) -> object:
        return str


@dataclass(frozen=True)
class Text:
    """A non-empty string; null or absent is the default (None: off)."""

    default: str | None = None

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> str | None:
        value = ctx.fields.optional_string(obj, key, path)
        return self.default if value is None else value

    def default_text(self) -> str:
        return _json(self.default)

    def allowed(self) -> str:
        return "non-empty string or null" + (f" (= {_json(self.default)})" if self.default is not None else "")

    def value_type(self) -> object:
        return str if self.default is not None else str | None


@dataclass(frozen=True)
class Custom:
    """A key with structure or rules of its own, read by `reader` from the raw JSON value (`default` when absent)."""

    #: Called with the context, the raw value and the key's whole JSON path; reports its problems to ctx.fields.
    reader: Callable[[ReadContext, Any, str], object]
    #: The docs' allowed column.
    allows: str
    default: object = None
    #: For the docs' default column only: the reader of a required key is handed None when it is absent, and says so.
    required: bool = False

    def read(self, ctx: ReadContext, obj: dict[str, Any], key: str, path: str) -> object:
        return self.reader(ctx, obj.get(key, self.default), join_path(path, key))

    def default_text(self) -> str:
        return "(required)" if self.required else _json(self.default)

    def allowed(self) -> str:
        return self.allows

    def value_type(self) -> object:
        return get_type_hints(self.reader)["return"]


@dataclass(frozen=True)
class Key:
    """One config key: its name (also its config dataclass field's), how it is read and applied, a one-line doc."""

    name: str
    value: Value
    applied: Applied
    #: The meaning column of docs/configuration.md (markdown, one line).
    doc: str


def read_object(fields: FieldReader, keys: Sequence[Key], raw: dict[str, Any], path: str, base: Path) -> dict[str, Any]:
    """Every declared key's value by name, read in declaration order; a key `raw` has but `keys` lacks is a problem."""
    fields.check_keys(raw, path, {key.name for key in keys})
    ctx = ReadContext(fields, base, {})
    for key in keys:
        ctx.earlier[key.name] = key.value.read(ctx, raw, key.name, path)
    return ctx.earlier
