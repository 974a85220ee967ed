"""Shortening a reason for status without cutting a sentence in half."""

from __future__ import annotations

import re

#: Long enough for a torch error with its advice (a guard, the range to declare); a traceback is for the log.
REASON_CHARS = 1500

_SENTENCE_END = re.compile(r"[.;:!?\n](?=\s)")


def clip(text: str, limit: int = REASON_CHARS) -> str:
    """`text` itself when it fits; else its whole sentences up to `limit`, saying how much was left out.

    Only a text with no sentence end inside the limit is cut at a word, and never mid-word where a space exists.
    """
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[:limit]
    ends = [m.end() for m in _SENTENCE_END.finditer(head)]
    cut = ends[-1] if ends and ends[-1] > limit // 3 else (head.rfind(" ") if " " in head else limit)
    kept = text[:cut].rstrip()
    return f"{kept} [{len(text) - len(kept)} more characters left out]"
