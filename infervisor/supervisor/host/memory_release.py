"""Giving the supervisor's memory back to the box after large client frames (glibc malloc).

libzmq allocates each received message whole with malloc. glibc serves a block over its mmap
threshold (128 KB) with mmap, but raises that threshold to the size of any such block freed, up to
32 MB: after the first 16 MB frame, every later one comes from the heap arenas of libzmq's I/O
threads, and the arenas keep what they grew to. 64 connections sending 16 MB frames left the
supervisor at ~670 MB RSS for good. A fixed threshold (mallopt turns the adjustment off) maps
every large block and unmaps it when freed; `malloc_trim` hands back the free top of each arena
once RSS has grown. Elsewhere than glibc both are skipped: the figures then depend on that malloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import structlog

log = structlog.get_logger("supervisor")

#: mallopt's parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD).
_M_MMAP_THRESHOLD = -3
#: Blocks from this size up are mapped on their own: any client frame that costs a page fault per
#: 4 KB anyway, small enough that a 600 KB image (the common large input) stays on the heap's reuse.
LARGE_BLOCK_BYTES = 1024 * 1024
#: RSS growth since the last trim that makes the next monitor turn trim again.
TRIM_AFTER_GROWTH_BYTES = 32 * 1024 * 1024
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only (musl has no malloc_trim either)
        libc.malloc_trim  # noqa: B018
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


class MemoryRelease:
    """Maps large blocks on their own (at start) and trims the heap when RSS has grown (each monitor turn)."""

    def __init__(self) -> None:
        self.libc = _glibc()
        self.baseline = 0
        self.trims = 0

    def map_large_blocks(self) -> None:
        """Serve every block of LARGE_BLOCK_BYTES or more with its own mapping, given back when freed."""
        if self.libc is None:
            log.info("memory_release_unavailable", why="not glibc: large frames may stay in the heap after use")
            return
        if not self.libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES):
            log.warning("memory_release_unavailable", why="mallopt(M_MMAP_THRESHOLD) refused")
        self.baseline = _rss_bytes()

    def trim_if_grown(self) -> None:
        """Hand free heap memory back when RSS grew by TRIM_AFTER_GROWTH_BYTES since the last look."""
        if self.libc is None:
            return
        rss = _rss_bytes()
        if rss < self.baseline + TRIM_AFTER_GROWTH_BYTES:
            self.baseline = min(self.baseline, rss)
            return
        self.libc.malloc_trim(0)
        self.trims += 1
        self.baseline = _rss_bytes()
