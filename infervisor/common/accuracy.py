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


def channel_limit(min_cosine: float) -> float:
    """The default `tolerance.max_channel_error` for a `min_cosine`: sqrt(10 (1 - min_cosine)), 0.1 at 0.999.

    On each output whose rows are matrices or more (a packed detection head `[batch, 4 + classes, anchors]`, a
    feature map, hidden states), each channel (a slice along the output's channel axis) is judged by its largest
    difference from eager over eager's largest magnitude on that channel, so class scores (0..1) beside box
    coordinates (hundreds) are judged on their own scale. A cosine c between two vectors allows a relative RMS
    difference of about sqrt(2 (1 - c)); each channel is held to that on its own scale, with its largest difference
    in place of the RMS (x sqrt(5): the largest of a few hundred errors is 2 to 3 of their RMS). So a model whose
    `min_cosine` was loosened for int8 gets a channel limit loosened alike (0.45 at 0.98), and at the default 0.999 a
    score channel moved by 0.15 fails (docs/optimization.md, "Parts of an output", has the figures).
    """
    return round(math.sqrt(10.0 * max(0.0, 1.0 - min_cosine)), 4)


#: The limit at the default min_cosine 0.999.
DEFAULT_MAX_CHANNEL_ERROR = channel_limit(0.999)
#: A channel whose largest magnitude is below this fraction of the output's is judged against that fraction instead:
#: a channel of near-zeros (a class absent from the image, a dead feature) has no scale of its own to be relative to.
CHANNEL_FLOOR = 1e-3
#: A profile's build note that starts with this is the sequence gate's verdict on a stateful model (what it walked,
#: the worst step): status shows it as the worker's `sequence_check`.
SEQUENCE_NOTE = "sequence gate: "
