"""What this CPU can do, read from /proc/cpuinfo without torch: the flags the profile strategy and doctor look at."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

#: Flags that decide the strategy (a flag not listed here is dropped by the parser, so a profile needing it is refused).
WATCHED_FLAGS = (
    "sse4_2", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


@dataclass(frozen=True)
class CpuCaps:
    """The watched flags this CPU has, and its model name."""

    flags: frozenset[str]
    model_name: str

    @property
    def tier(self) -> str:
        """amx, avx512, avx2 or sse4_2 (or baseline): the instruction-set layer of the CPU acceleration stack."""
        for tier, flag in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2"), ("sse4_2", "sse4_2")):
            if flag in self.flags:
                return tier
        return "baseline"


def parse_cpuinfo(text: str) -> CpuCaps:
    """Flags and model name of the first processor block."""
    flags: set[str] = set()
    model_name = "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and model_name == "unknown":
            model_name = value.strip()
        elif not line.strip() and flags:
            break
    return CpuCaps(frozenset(flags) & frozenset(WATCHED_FLAGS), model_name)


def read_caps(path: Path = Path("/proc/cpuinfo")) -> CpuCaps:
    """This machine's capabilities (empty flags if cpuinfo cannot be read)."""
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        return CpuCaps(frozenset(), "unknown")


def cpu_flags_digest(path: Path = Path("/proc/cpuinfo")) -> str:
    """The full flag list of this CPU as a short digest: part of every compiled package's cache key (inductor
    compiles for the exact machine, -march=native), and of the capability key a cache bundle is checked against."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    flags = next((line.partition(":")[2] for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
