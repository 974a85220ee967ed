"""What a worker or the warm template does to hold only the memory it needs: garbage and pages back to the kernel."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import re
import time
from pathlib import Path

import structlog

log = structlog.get_logger("worker")

_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21
#: Where torch's AOTInductor loader extracts a package's shared library before loading it. The folder is removed once
#: the package is loaded (profiles/package_scratch.py), so the kernel names the mapping's file `... (deleted)`.
_PACKAGE_LIBRARY = re.compile(r"/aotinductor_[^/]+/.*\.so(?: \(deleted\))?$")
#: OpenVINO's cached IR weights (`openvino*-<key>.bin`) and compiled blobs (`openvino/<hash>.blob`): the CPU plugin
#: maps them shared and read-only, and serves from its own repacked copy of the weights.
_OPENVINO_WEIGHTS = re.compile(r"/openvino[a-z0-9_]*-[0-9a-f]{32}\.bin$|/openvino/[0-9]+\.blob$")
#: A mapping's first line in /proc/self/smaps: `start-end perms offset dev inode [path]`.
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def package_weight_mappings(smaps: str) -> list[tuple[int, int]]:
    """The read-only, never-written file mappings of loaded package libraries: (start, length) each.

    AOTInductor copies a package's weights out of its library into a buffer of its own at load time;
    the library's copy (the bulk of the file) is never read again. Only mappings with no anonymous
    (copy-on-write) page qualify: the relocated RELRO segment is read-only too, but written once.
    """
    found: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in smaps.splitlines():
        match = _MAPPING.match(line)
        if match is not None:
            start, end, perms, path = match.groups()
            current = (int(start, 16), int(end, 16) - int(start, 16)) if _weights_file(perms, path) else None
        elif current is not None and line.startswith("Anonymous:"):
            if line.split()[1] == "0":
                found.append(current)
            current = None
    return found


def _weights_file(perms: str, path: str) -> bool:
    """A read-only mapping of a package library's or an OpenVINO cache's file: where on-file weights may be mapped."""
    return (perms == "r--p" and _PACKAGE_LIBRARY.search(path) is not None) or (
        perms in ("r--p", "r--s") and _OPENVINO_WEIGHTS.search(path) is not None
    )


def maps_weights_files(maps: str) -> bool:
    """Whether /proc/self/maps (`maps`) shows any mapping `package_weight_mappings` could pick."""
    return any((m := _MAPPING.match(line)) is not None and _weights_file(m[3], m[4]) for line in maps.splitlines())


def drop_package_weight_pages() -> int:
    """Unmap the resident pages of the packages' on-file weights (they fault back in from the file if read); bytes."""
    libc = _libc()
    if libc is None:
        return 0
    try:
        # smaps walks the page tables of every mapping (35-95 ms in a worker forked from the warm template, a fifth
        # of a tiny worker's way back after a kill); maps does not, and an eager worker maps no package at all.
        if not maps_weights_files(Path("/proc/self/maps").read_text()):
            return 0
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, length in package_weight_mappings(smaps):
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED) == 0:
            dropped += length
    return dropped


def page_out_unshared_library_pages() -> int:
    """Ask the kernel to reclaim this process's resident pages of read-only file mappings that no other process maps
    (MADV_PAGEOUT, Linux 5.4+); the bytes of the mappings advised, 0 where the kernel has no such advice.

    The warm template's imports touch pages of libtorch (static initialisers, registration tables: 42 MB on
    torch 2.13) that no child reads again; they are clean, so the kernel can drop them, and a page a child does
    use is mapped by that child too and stays (the advice skips pages mapped by more than one process).
    """
    libc = _libc()
    if libc is None:
        return 0
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in maps.splitlines():
        match = _MAPPING.match(line)
        # Read-only file mappings only: their pages are the file's, never this process's own writes.
        if match is None or not match[4].startswith("/") or match[3] not in ("r--p", "r-xp"):
            continue
        start, end = int(match[1], 16), int(match[2], 16)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_PAGEOUT) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # a kernel older than 5.4: nothing else will work either
                return advised
            continue
        advised += end - start
    return advised


def trim_heap() -> bool:
    """glibc's malloc_trim(0): free heap pages go back to the kernel (False where the C library has none)."""
    libc = _libc()
    try:
        trim = libc.malloc_trim if libc is not None else None
    except AttributeError:  # musl and others: nothing to trim with
        return False
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def release_unused_memory() -> None:
    """Collect unreachable objects (a module's reference cycles), then hand the freed heap back to the kernel.

    Without the trim, glibc keeps the freed arenas of a start (the eager weights a package replaced, the
    gate's golden inputs and outputs): 40-50 MB of a ResNet-50 worker that never shrinks otherwise. Then
    the pages of each loaded package's weights still mapped from its library file go (25 MB per int8
    ResNet-50 package): the loader copied them out, and they are not read again. So do the pages of an
    OpenVINO IR's weights or compiled blob the CPU plugin mapped (97 MB for fp32 ResNet-50): it serves from
    its own repacked copy.
    """
    started = time.perf_counter()
    gc.collect()  # ~0.1 s with torch imported: it walks every object once
    # What survived is the serving process's for life: later collections skip it (no 0.1 s pause mid-request).
    gc.freeze()
    trimmed = trim_heap()
    dropped = drop_package_weight_pages()
    took_ms = round((time.perf_counter() - started) * 1000.0, 1)
    log.info("memory_released", trimmed=trimmed, package_pages_mb=round(dropped / 2**20, 1), took_ms=took_ms)
