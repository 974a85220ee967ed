"""Reasons for status: shortened at a sentence, never in the middle of one, and compared without addresses."""

from __future__ import annotations

from infervisor.common.text import clip
from infervisor.supervisor.lifecycle.pool import same_error


def test_a_short_reason_is_kept_whole() -> None:
    """Nothing is cut from a reason under the limit."""
    assert clip("aoti failed to build: declare [11, 74].") == "aoti failed to build: declare [11, 74]."


def test_a_long_reason_ends_at_its_last_whole_sentence() -> None:
    """The cut falls after the last sentence that fits, and says how much was left out."""
    text = "First sentence. " * 10 + "A very long sentence " + "word " * 100
    clipped = clip(text, 200)
    assert clipped.startswith("First sentence. First") and "First sentence. [" in clipped
    assert clipped.endswith("more characters left out]") and "A very" not in clipped


def test_load_errors_that_differ_only_in_object_addresses_are_the_same() -> None:
    """A repr's address differs in every process; the message does not."""
    assert same_error("bad module <M object at 0x7f01>", "bad module <M object at 0x7e99ab>")
    assert not same_error("download interrupted after 12 bytes", "download interrupted after 13 bytes")
