"""Typed reads out of parsed JSON that collect every problem as `json.path: why` instead of stopping at the first."""

from __future__ import annotations

import math
from typing import Any

#: Integers without a tighter upper bound stop here.
INTEGER_LIMIT = 2**62


def join_path(path: str, key: str) -> str:
    """`models.m` + `workers` -> `models.m.workers`; top-level keys have no prefix."""
    return f"{path}.{key}" if path else key


class FieldReader:
    """Reads typed values out of a JSON object, collecting problems instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, path: str, why: str) -> None:
        self.problems.append(f"{path}: {why}")

    def check_keys(self, obj: dict[str, Any], path: str, allowed: set[str]) -> None:
        for key in sorted(set(obj) - allowed):
            self.fail(join_path(path, key), f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def integer(
        self,
        obj: dict[str, Any],
        key: str,
        path: str,
        default: int,
        low: int,
        high: int = INTEGER_LIMIT,
        why: str | None = None,
    ) -> int:
        """`why` replaces the problem text where the bounds alone would not say what the value means."""
        value = obj.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            text = why or f"must be an integer in [{low}, {high}]"
            self.fail(join_path(path, key), f"{text}, got {value!r}")
            return default
        return value

    def number(self, obj: dict[str, Any], key: str, path: str, default: float, low: float) -> float:
        value = obj.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
            self.fail(join_path(path, key), f"must be a finite number >= {low}, got {value!r}")
            return default
        return float(value)

    def boolean(self, obj: dict[str, Any], key: str, path: str, default: bool) -> bool:
        value = obj.get(key, default)
        if not isinstance(value, bool):
            self.fail(join_path(path, key), f"must be true or false, got {value!r}")
            return default
        return value

    def fraction(self, obj: dict[str, Any], key: str, path: str, default: float, high: float) -> float:
        value = self.number(obj, key, path, default, 0.0)
        if value > high:
            self.fail(join_path(path, key), f"must be between 0 and {high}, got {value!r}")
            return default
        return value

    def optional_number(self, obj: dict[str, Any], key: str, path: str, low: float) -> float | None:
        if obj.get(key) is None:
            return None
        return self.number(obj, key, path, low, low)

    def optional_integer(self, obj: dict[str, Any], key: str, path: str, low: int) -> int | None:
        if obj.get(key) is None:
            return None
        return self.integer(obj, key, path, low, low)

    def optional_string(self, obj: dict[str, Any], key: str, path: str) -> str | None:
        return self.string_or_null(obj.get(key), join_path(path, key))

    def string_or_null(self, value: Any, where: str) -> str | None:
        """A value already taken out of its object (`where` is its whole path): a non-empty string, or None."""
        if value is not None and (not isinstance(value, str) or not value):
            self.fail(where, f"must be a non-empty string or null, got {value!r}")
            return None
        return value
