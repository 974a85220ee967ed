"""The names of the built-in models, so the supervisor can refuse an unknown one before any worker starts."""

from __future__ import annotations

#: Built in code by infervisor/worker/models (`tests/test_registry.py` holds the two lists together).
BUILTIN_MODELS = ("resnet50", "resnet18", "encoder", "tiny")
