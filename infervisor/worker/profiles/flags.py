"""The process-global torch switches of the profiles: set from each profile's declaration, in this one place."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from infervisor.common.profiles import PROFILES, GlobalFlag

#: How each declared flag is switched; every GlobalFlag has one (a test checks it).
SETTERS: Mapping[GlobalFlag, Callable[[bool], None]] = MappingProxyType(
    {GlobalFlag.ONEDNN_FUSION: torch.jit.enable_onednn_fusion}
)


def apply_global_flags(profile: str) -> None:
    """Switch on the flags `profile` needs and every other one off (all off for an undeclared name)."""
    declared = PROFILES.get(profile)
    needed = declared.global_flags if declared is not None else frozenset()
    for flag, switch in SETTERS.items():
        switch(flag in needed)


def reset_global_flags() -> None:
    """Every flag off: the process as eager runs."""
    for switch in SETTERS.values():
        switch(False)
