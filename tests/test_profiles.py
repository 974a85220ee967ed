"""Optimisation profiles: CPU strategy, validation against eager, fallback along the configured chain."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from supervisor.config import ConfigError, parse_config
from tests.conftest import IMAGE_INPUTS, Daemon, model_entry
from worker.cpu_caps import parse_cpuinfo, read_caps
from worker.models import build_builtin
from worker.profiles.validate import Tolerance, compare

SSE_ONLY = (
    "processor\t: 0\nmodel name\t: Intel(R) Celeron(R) J1900\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt\n\n"
)
AVX512 = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni\n\n"


def test_cpu_tiers_decide_which_profiles_are_tried() -> None:
    """SSE4.2-only boxes get eager only; bf16 needs AMX or avx512_bf16; this machine's flags are read."""
    celeron, xeon = parse_cpuinfo(SSE_ONLY), parse_cpuinfo(AVX512)
    assert celeron.tier == "sse4_2" and celeron.model_name.startswith("Intel(R) Celeron")
    assert celeron.refusal("eager") is None and "no AVX2" in (celeron.refusal("jit") or "")
    assert xeon.tier == "avx512" and xeon.refusal("jit_onednn") is None
    assert "bf16" in (xeon.refusal("bf16") or "")
    assert read_caps().tier in {"amx", "avx512", "avx2", "sse4_2", "baseline"}


def test_agreement_measures_cosine_error_and_top1() -> None:
    """compare() reports cosine, max abs error and argmax agreement; the tolerance names what failed."""
    reference = [np.array([[0.1, 0.9, 0.0]], np.float32)]
    assert compare(reference, reference).failure(Tolerance(min_cosine=1.0, max_abs_error=0.0, top1=True)) is None
    flipped = compare(reference, [np.array([[0.9, 0.1, 0.0]], np.float32)])
    assert not flipped.top1_agree and "cosine" in (flipped.failure(Tolerance()) or "")
    assert "top-1" in (flipped.failure(Tolerance(min_cosine=-1.0, top1=True)) or "")
    assert "not finite" in (compare(reference, [np.full((1, 3), np.nan, np.float32)]).failure(Tolerance()) or "")
    assert compare(reference, [np.zeros((2, 3), np.float32)]).max_abs_error == float("inf")


def test_unknown_profile_names_are_config_errors() -> None:
    """A typo in the chain is refused with its JSON path."""
    model = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 16]}]}
    text = json.dumps({"models": {"m": {**model, "profiles": ["jit", "turbo"]}}})
    with pytest.raises(ConfigError) as caught:
        parse_config(text, Path("."))
    assert any(p.startswith("models.m.profiles[1]:") for p in caught.value.problems)


def test_chain_serves_the_first_profile_that_matches_eager_and_reports_the_rest(
    start_daemon: Callable[..., Daemon],
) -> None:
    """jit_onednn (channels_last) serves resnet18 within tolerance; an impossible tolerance falls back to eager."""
    config = {
        "oversubscribe": True,
        "models": {
            "fast": model_entry(
                {"builtin": "resnet18"}, IMAGE_INPUTS, profiles=["jit_onednn", "jit", "eager"], channels_last=True
            ),
            "strict": model_entry(
                {"builtin": "resnet18"}, IMAGE_INPUTS, profiles=["jit", "eager"],
                tolerance={"min_cosine": 1.0, "max_abs_error": 0.0},
            ),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(timeout=180)
    fast = status["models"]["fast"]["workers"][0]
    strict = status["models"]["strict"]["workers"][0]
    assert fast["profile"] == "jit_onednn" and fast["profile_skipped"] == []
    assert strict["profile"] == "eager" and strict["profile_skipped"][0].startswith("jit: ")
    x = np.random.default_rng(5).standard_normal((2, 3, 224, 224)).astype(np.float32)
    torch.set_num_threads(1)
    with torch.inference_mode():
        expected = build_builtin("resnet18")(torch.from_numpy(x)).numpy()
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("fast", {"image": x})["logits"], expected, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(client.infer("strict", {"image": x})["logits"], expected, rtol=1e-4, atol=1e-5)
