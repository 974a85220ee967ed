"""Building random-weight models fast: skip the default init of layers the model initialises itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def default_init_skipped(*layer_types: type[nn.Module]) -> Iterator[None]:
    """Within the block, these layer types are built without their default init.

    Only for models whose constructor then initialises every parameter of those layers itself:
    the default init would be work thrown away (it was half of ResNet-50's 0.5 s build).
    """
    originals = {cls: cls.reset_parameters for cls in layer_types}  # type: ignore[attr-defined]
    for cls in layer_types:
        cls.reset_parameters = lambda self: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.reset_parameters = original  # type: ignore[attr-defined]
