"""The optimisation profiles, declared once: what each one is, what CPU it needs, what it risks and what it switches.

Config and launch validation, the worker's capability strategy, `infervisor optimize`, `doctor` and
`bench` read this table; the builder of each profile lives worker-side (infervisor/worker/profiles/build.py),
registered under the same name. The order of the table is the default order of `bench` and `optimize`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from infervisor.common.cpuinfo import CpuCaps


class GlobalFlag(enum.Enum):
    """A process-wide torch switch: on while a profile that needs it builds and serves, off for every other one."""

    #: torch.jit.enable_onednn_fusion: oneDNN Graph fuses conv+bn+relu in a frozen TorchScript graph.
    ONEDNN_FUSION = "onednn_fusion"


@dataclass(frozen=True)
class CpuNeed:
    """CPU flags of which a profile needs at least one, and why it is refused on a CPU with none of them."""

    any_of: frozenset[str]
    #: The refusal text; `{tier}` becomes the CPU's tier.
    reason: str

    def refusal(self, caps: CpuCaps) -> str | None:
        """The reason when `caps` has none of the flags, else None."""
        return None if self.any_of & caps.flags else self.reason.format(tier=caps.tier)


#: Without AVX2 the oneDNN kernels behind the traced, compiled and quantized paths fall back to slow ones.
FAST_KERNELS = CpuNeed(frozenset({"avx2", "avx512f"}), "cpu tier {tier}: no AVX2, so only eager fp32 is worth running")
#: Without native bf16 instructions bf16 is emulated, and slower than the fp32 it replaces.
NATIVE_BF16 = CpuNeed(
    frozenset({"amx_bf16", "avx512_bf16"}), "no AMX or avx512_bf16: bf16 runs slower than fp32 (measured 3x on AVX-512)"
)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """One optimisation profile: its name (part of the config contract) and what both sides know of it."""

    name: str
    #: One line: what the worker does to the loaded module.
    summary: str
    #: What it risks beside its measured numbers (shown by `infervisor optimize`).
    risk: str
    #: Every CPU need must be met, in this order; the first unmet one is the refusal.
    cpu: tuple[CpuNeed, ...]
    #: Its build product (an AOTInductor package, OpenVINO IR) is kept in cache_dir: the first start builds, a
    #: restart loads, and `infervisor build` fills it.
    packaged: bool = False
    #: Process-wide switches on while it builds and serves.
    global_flags: frozenset[GlobalFlag] = frozenset()
    #: Computes in less than fp32 (int8, bf16): agreement with eager on synthetic inputs says little about real ones.
    changes_numerics: bool = False
    #: Serves the loaded module with no build step (no trace, export or compile): a worker that serves first
    #: (the background builder has not finished) may start on it.
    builds_nothing: bool = False

    def refusal(self, caps: CpuCaps) -> str | None:
        """Why this profile is not worth trying on a CPU with `caps`, or None when it is."""
        return next((reason for need in self.cpu if (reason := need.refusal(caps)) is not None), None)


_DECLARED = (
    Profile(
        name="eager",
        summary="the module as loaded, in eval() under inference_mode: the reference every other profile is checked on",
        risk="none: the reference",
        cpu=(),
        builds_nothing=True,
    ),
    Profile(
        name="jit",
        summary="TorchScript (trace, or the scripted file), frozen, then optimize_for_inference",
        risk="TorchScript is deprecated; tracing bakes in Python control flow (checked at batch 1 and N)",
        cpu=(FAST_KERNELS,),
    ),
    Profile(
        name="jit_onednn",
        summary="TorchScript, frozen, with oneDNN Graph fusion (conv+bn+relu) switched on",
        risk="as jit; the oneDNN fusion flag is process-wide",
        cpu=(FAST_KERNELS,),
        global_flags=frozenset({GlobalFlag.ONEDNN_FUSION}),
    ),
    Profile(
        name="compile",
        summary="torch.compile with inductor and freezing, compiled on the first golden run",
        risk="compiles at every start; a new input shape recompiles while serving",
        cpu=(FAST_KERNELS,),
    ),
    Profile(
        name="aoti",
        summary="torch.export, then an AOTInductor package",
        risk="the first start compiles (cached after); export refuses data-dependent control flow",
        cpu=(FAST_KERNELS,),
        packaged=True,
    ),
    Profile(
        name="int8_static",
        summary="PT2E int8 (X86InductorQuantizer) calibrated on the calibration set, then an AOTInductor package",
        risk="accuracy rests on the calibration set",
        cpu=(FAST_KERNELS,),
        packaged=True,
        changes_numerics=True,
    ),
    Profile(
        name="int8_dynamic",
        summary="PT2E int8 weights with activations quantized per call, then an AOTInductor package",
        risk="activations quantized per call: accuracy varies with input range",
        cpu=(FAST_KERNELS,),
        packaged=True,
        changes_numerics=True,
    ),
    Profile(
        name="bf16",
        summary="the module under CPU bf16 autocast (outputs back to float32)",
        risk="reduced precision (8-bit mantissa)",
        cpu=(FAST_KERNELS, NATIVE_BF16),
        changes_numerics=True,
        builds_nothing=True,
    ),
    # The OpenVINO profiles (infervisor/worker/profiles/openvino.py) need the `openvino` extra;
    # without it they are skipped.
    Profile(
        name="openvino",
        summary="openvino.convert_model of the module (dynamic dims kept), run by OpenVINO's CPU plugin in fp32",
        risk="needs the openvino extra; the first start converts (the IR and compiled blob are cached after)",
        cpu=(FAST_KERNELS,),
        packaged=True,
    ),
    Profile(
        name="openvino_bf16",
        summary="the openvino profile's IR compiled with INFERENCE_PRECISION_HINT bf16",
        risk="reduced precision (8-bit mantissa); needs the openvino extra",
        cpu=(FAST_KERNELS, NATIVE_BF16),
        packaged=True,
        changes_numerics=True,
    ),
    Profile(
        name="openvino_int8",
        summary="the openvino profile's IR quantized by NNCF (post-training, on the calibration set), then compiled",
        risk="accuracy rests on the calibration set; needs the openvino extra (openvino and nncf)",
        cpu=(FAST_KERNELS,),
        packaged=True,
        changes_numerics=True,
    ),
)

#: Every declared profile by name, in declaration order.
PROFILES: Mapping[str, Profile] = MappingProxyType({profile.name: profile for profile in _DECLARED})
if len(PROFILES) != len(_DECLARED):
    raise ImportError("two profiles in infervisor/common/profiles.py share a name")
#: The names a config's `profiles` chain may use.
PROFILE_NAMES = tuple(PROFILES)
#: The profile every other one is checked against, and the last resort of every chain.
REFERENCE_PROFILE = "eager"


def cpu_refusal(name: str, caps: CpuCaps) -> str | None:
    """Why profile `name` is not worth trying on `caps`; None when it is, or when no such profile is declared."""
    profile = PROFILES.get(name)
    return profile.refusal(caps) if profile is not None else None


#: A build note of a fastest pick that starts with this says at which input size its candidates were timed: status
#: shows it as the worker's and the background build's `timed_at`.
TIMED_AT_NOTE = "pick timed at "
