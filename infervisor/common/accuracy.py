"""How an agreement with eager is printed: both sides (the worker's gate, `infervisor optimize`) use the same digits."""

from __future__ import annotations

import math


def cosine_text(cosine: float, min_cosine: float | None = None) -> str:
    """A cosine with six significant digits after its leading nines (7 to 12 decimals), and more when fewer would
    print it on the other side of `min_cosine`: 0.99989999 is never shown as 0.9999000 against 0.9999."""
    if not math.isfinite(cosine):
        return str(cosine)
    text = f"{abs(cosine):.17f}"
    nines = len(text[2:]) - len(text[2:].lstrip("9")) if text.startswith("0.") else 0
    decimals = min(12, max(7, nines + 6))
    shown = f"{cosine:.{decimals}f}"
    if min_cosine is not None:
        while decimals < 17 and (float(shown) < min_cosine) != (cosine < min_cosine):
            decimals += 1
            shown = f"{cosine:.{decimals}f}"
    return shown


#: An output whose rows (one per sample) hold at most this many values is judged by its relative error too: a
#: cosine over so few values barely moves (over one value it only compares signs), so it cannot fail such an output.
FEW_VALUES_PER_ROW = 8
#: The default `tolerance.max_rel_error`: the largest absolute difference from eager on such an output, as a
#: fraction of the largest magnitude eager gives on it (a probability 5% off fails; bf16 autocast, 0.1-0.3% on a
#: small score head, passes).
DEFAULT_MAX_REL_ERROR = 0.02
#: A profile's build note that starts with this is a warning about the evidence it was judged on (a margin thinner
#: than the rows' spread, scales fitted on the samples that judge them): status shows it as the accuracy warning.
ACCURACY_WARNING_NOTE = "accuracy warning: "
#: A profile's build note that starts with this is the sequence gate's verdict on a stateful model (what it walked,
#: the worst step): status shows it as the worker's `sequence_check`.
SEQUENCE_NOTE = "sequence gate: "
