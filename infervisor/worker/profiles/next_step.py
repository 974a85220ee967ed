"""What a user can change when a profile cannot be built: known failures mapped to the change that avoids them.

A build failure quotes the library's own words (torch, inductor, OpenVINO), which name an internal pass, not the
model or the config. Each known failure adds what caused it in the model's terms and the next step; any other still
says which profile to take out of `profiles` so the daemon stops building it on every start.
"""

from __future__ import annotations

#: (words of the library's error, all present, what they mean for the model and what to change). Each cause is read
#: from the library source that raises it (named), so the advice says no more than the check does.
_KNOWN: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        # torch/_inductor/fx_passes/quantization.py: a quantized conv followed by an add is fused to write its
        # result into the add's other operand ("accum") in place, which it asserts is no view and not aliased.
        ("QConv Binary Inplace Fusion requires accum is not an alias or mutation",),
        "the model adds a convolution's output to a tensor that is a view of another (a chunk, split or slice of a "
        "feature map, as a residual over half of a C2f/CSP block's channels does) or that is written in place, and "
        "int8 fuses that add into the convolution by writing into its other operand: add to a copy in the model "
        "(`b.clone() + conv(b)`), or take int8_static out of `profiles` (openvino_int8 quantizes through OpenVINO, "
        "without this fusion)",
    ),
    (
        # torch/__init__.py sym_max / sym_min: called with None where a size or bound was expected.
        ("numpy.integer", "got <class 'NoneType'>"),
        "the compiler took the min or max of a size with nothing (torch.sym_max/sym_min got None): a size of an "
        "intermediate tensor it could not work out over the declared ranges (a slice or resize bound computed from "
        "an input size); when the package over the declared ranges is the one that failed, declaring the dims fixed "
        "at the size served, or in steps [min, max, step], avoids it; else take aoti out of `profiles`",
    ),
)


def next_step(profile: str, detail: str) -> str:
    """What to change after `profile` failed to build with `detail`: the known cause's advice, else the generic one."""
    for words, advice in _KNOWN:
        if all(word in detail for word in words):
            return advice
    return f"take {profile} out of `profiles` so the daemon stops building it on every start"


#: What to do when torch.export refuses the declared ranges of an open dim (a guard such as `(audio.shape[2] // 4)
#: == 64` under a MaxPool): the profiles that need no export, or a fixed size. Said first: a range that one
#: re-export covered (`declare [1000, 1003]`) is no answer for audio of any length.
OPEN_LENGTH_STEP = (
    "this model cannot be exported with an open length: serve eager, jit or openvino (they need no export), or "
    "declare each open dim fixed at the size served"
)


def with_next_step(profile: str, detail: str) -> str:
    """`detail` and what to change, unless it already says (export's coverage advice names a range to declare)."""
    if "out of the chain" in detail or "out of `profiles`" in detail:
        return detail
    return f"{detail} (next step: {next_step(profile, detail)})"


def package_step(shapes: str, example: str, declared: str) -> str:
    """Which AOTInductor package failed (`static`, `dynamic`, `batch N`) and what that says to change."""
    if shapes == "dynamic":
        return (
            f"the package for the example's fixed shapes ({example}) compiled; this one covers the declared ranges "
            f"({declared}): declaring the dynamic dims fixed at the size served (or in steps, [min, max, step], where "
            "the model takes only some sizes) avoids it"
        )
    if shapes == "static":
        return f"the package for the example's fixed shapes ({example}) failed, so no declared range is the cause"
    return f"the package for {shapes} failed at {example}"
