"""The profile registry: one declaration per profile in common/, one builder per declaration in the worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infervisor.common.cpuinfo import WATCHED_FLAGS, parse_cpuinfo, read_caps
from infervisor.common.profiles import PROFILE_NAMES, PROFILES, GlobalFlag, cpu_refusal
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.models import build_builtin
from infervisor.worker.profiles.build import build_profile
from infervisor.worker.profiles.builders import BUILDERS, BuildContext, ProfileError, builds
from infervisor.worker.profiles.flags import SETTERS, apply_global_flags, reset_global_flags

ROOT = Path(__file__).resolve().parent.parent
SSE_ONLY = (
    "processor\t: 0\nmodel name\t: Intel(R) Celeron(R) J1900\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt\n\n"
)
AVX512 = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni\n\n"


def test_cpu_tiers_decide_which_profiles_are_tried() -> None:
    """SSE4.2-only boxes get eager only; bf16 needs AMX or avx512_bf16; this machine's flags are read."""
    celeron, xeon = parse_cpuinfo(SSE_ONLY), parse_cpuinfo(AVX512)
    assert celeron.tier == "sse4_2" and celeron.model_name.startswith("Intel(R) Celeron")
    assert cpu_refusal("eager", celeron) is None
    assert cpu_refusal("jit", celeron) == "cpu tier sse4_2: no AVX2, so only eager fp32 is worth running"
    assert cpu_refusal("bf16", celeron) == cpu_refusal("jit", celeron)
    assert xeon.tier == "avx512" and cpu_refusal("jit_onednn", xeon) is None
    assert cpu_refusal("bf16", xeon) == "no AMX or avx512_bf16: bf16 runs slower than fp32 (measured 3x on AVX-512)"
    assert cpu_refusal("turbo", celeron) is None  # not declared: its builder, not the CPU, refuses it
    assert read_caps().tier in {"amx", "avx512", "avx2", "sse4_2", "baseline"}


def test_every_declared_profile_has_one_builder_and_no_builder_lacks_a_declaration() -> None:
    """The worker's builder table and the common declarations name exactly the same profiles."""
    assert set(BUILDERS) == set(PROFILE_NAMES) == set(PROFILES)
    with pytest.raises(LookupError, match="no declaration"):
        builds("turbo")
    with pytest.raises(LookupError, match="two builders"):
        builds("eager")


def test_cpu_needs_name_only_flags_the_parser_keeps() -> None:
    """A need for a flag that parse_cpuinfo drops would refuse its profile on every CPU."""
    for profile in PROFILES.values():
        for need in profile.cpu:
            assert need.any_of <= set(WATCHED_FLAGS), profile.name


def test_global_flags_are_switched_from_the_declarations() -> None:
    """Every flag has a setter; a profile turns on only the flags it declares, and reset turns them all off."""
    assert set(SETTERS) == set(GlobalFlag)
    assert [p.name for p in PROFILES.values() if GlobalFlag.ONEDNN_FUSION in p.global_flags] == ["jit_onednn"]
    try:
        apply_global_flags("jit_onednn")
        assert torch.jit.onednn_fusion_enabled()
        apply_global_flags("jit")
        assert not torch.jit.onednn_fusion_enabled()
        apply_global_flags("jit_onednn")
        reset_global_flags()
        assert not torch.jit.onednn_fusion_enabled()
    finally:
        reset_global_flags()


def test_packaged_declarations_are_the_profiles_whose_builders_need_the_cache() -> None:
    """Built without a cache directory, exactly the profiles declared packaged refuse (the others build)."""
    specs = (TensorSpec("x", "float32", (None, 16)),)
    context = BuildContext(build_builtin("tiny"), (torch.randn(1, 16),), specs, "digest")
    needs_cache = set()
    try:
        for name in PROFILE_NAMES:
            try:
                build_profile(name, context)
            except ProfileError as exc:
                assert "needs an artifact cache directory" in str(exc), exc
                needs_cache.add(name)
    finally:
        reset_global_flags()
    packaged = {"aoti", "int8_static", "int8_dynamic", "openvino", "openvino_bf16", "openvino_int8"}
    assert needs_cache == {p.name for p in PROFILES.values() if p.packaged} == packaged


def test_numerics_changing_profiles_are_the_int8_and_bf16_ones() -> None:
    """The profiles whose accuracy a synthetic check cannot vouch for are marked."""
    changing = {"int8_static", "int8_dynamic", "bf16", "openvino_bf16", "openvino_int8"}
    assert {p.name for p in PROFILES.values() if p.changes_numerics} == changing


def test_the_supervisor_reads_the_registry_without_loading_torch() -> None:
    """Config validation, the CLI, optimize and doctor import the declarations and no torch, at run time too."""
    modules = ", ".join(
        f"infervisor.supervisor.{name}" for name in ("cli", "settings.config", "commands.optimize", "toolkit.doctor")
    )
    loaded = "m == 'torch' or m.startswith('torch.') or m.startswith('infervisor.worker')"
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if {loaded}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_builtin_names_the_supervisor_checks_are_the_models_the_worker_builds() -> None:
    """A config naming a built-in is refused by the supervisor exactly when no worker could build it."""
    from infervisor.common.builtin_models import BUILTIN_MODELS
    from infervisor.worker.models import BUILTIN_OUTPUTS, BUILTINS

    assert set(BUILTIN_MODELS) == set(BUILTINS) == set(BUILTIN_OUTPUTS)
