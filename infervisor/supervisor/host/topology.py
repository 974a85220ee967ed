"""Read the logical CPU, physical core and NUMA node layout from a sysfs tree."""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LogicalCpu",
    "Topology",
    "TopologyError",
    "format_cpu_list",
    "parse_cpu_list",
    "read_topology",
]

_CPU_DIR_RE = re.compile(r"cpu(\d+)")
_NODE_DIR_RE = re.compile(r"node(\d+)")


class TopologyError(Exception):
    """Raised when the sysfs tree cannot be turned into a usable topology."""


@dataclass(frozen=True)
class LogicalCpu:
    """One online logical CPU and where it sits in the machine."""

    cpu: int
    package: int
    core: int
    node: int
    siblings: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """The online logical CPUs of a machine, sorted by CPU id."""

    cpus: tuple[LogicalCpu, ...]

    def cpu_ids(self) -> list[int]:
        """Return the sorted ids of all online logical CPUs."""
        return sorted(c.cpu for c in self.cpus)

    def cpu(self, cpu_id: int) -> LogicalCpu:
        """Return the logical CPU with this id, raising KeyError if it is not online."""
        for c in self.cpus:
            if c.cpu == cpu_id:
                return c
        raise KeyError(cpu_id)

    def nodes(self) -> list[int]:
        """Return the sorted ids of the NUMA nodes that have at least one online CPU."""
        return sorted({c.node for c in self.cpus})

    def cpus_on_node(self, node: int) -> list[int]:
        """Return the sorted ids of the online logical CPUs on one NUMA node."""
        return sorted(c.cpu for c in self.cpus if c.node == node)

    def physical_cores(self) -> list[tuple[int, ...]]:
        """Return the logical CPUs of each physical core, grouped by (package, core) and ordered by lowest CPU id."""
        groups: dict[tuple[int, int], list[int]] = {}
        for c in self.cpus:
            groups.setdefault((c.package, c.core), []).append(c.cpu)
        return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0])


def parse_cpu_list(text: str) -> list[int]:
    """Parse a kernel cpu list such as "0-3,8,10-11" into a sorted list of unique CPU ids."""
    stripped = text.strip()
    if not stripped:
        return []
    cpus: set[int] = set()
    for part in stripped.split(","):
        item = part.strip()
        if not item:
            raise ValueError(f"invalid cpu list {text!r}: empty item")
        first, sep, last = item.partition("-")
        start = _parse_cpu_id(first, text)
        end = _parse_cpu_id(last, text) if sep else start
        if end < start:
            raise ValueError(f"invalid cpu list {text!r}: range {item!r} is descending")
        cpus.update(range(start, end + 1))
    return sorted(cpus)


def _parse_cpu_id(token: str, text: str) -> int:
    """Parse one CPU id from a cpu list, raising ValueError that quotes the whole list."""
    token = token.strip()
    # isdigit() alone would accept non-ASCII digits that int() also accepts, so restrict to ASCII.
    if not token.isascii() or not token.isdigit():
        raise ValueError(f"invalid cpu list {text!r}: {token!r} is not a non-negative integer")
    return int(token)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Format CPU ids as a compact kernel-style cpu list such as "0-3,8,10-11"."""
    ids = sorted(set(cpus))
    if ids and ids[0] < 0:
        raise ValueError(f"cpu ids must be non-negative, got {ids[0]}")
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def read_topology(sysfs_root: Path = Path("/sys")) -> Topology:
    """Read the online CPUs, their package/core/sibling layout and NUMA nodes from a sysfs tree."""
    cpu_root = sysfs_root / "devices" / "system" / "cpu"
    online = _online_cpus(cpu_root)
    if not online:
        raise TopologyError(f"no CPUs found under {cpu_root} (checked {cpu_root / 'online'} and cpuN directories)")
    online_set = set(online)
    node_of = _cpu_nodes(sysfs_root / "devices" / "system" / "node")

    cpus: list[LogicalCpu] = []
    for cpu in online:
        topo_dir = cpu_root / f"cpu{cpu}" / "topology"
        # Without topology files (some VMs, containers with a trimmed /sys) the only safe
        # assumption is that the CPU is a core of its own, so it is never paired with another.
        package = _read_int(topo_dir / "physical_package_id", default=0)
        core = _read_int(topo_dir / "core_id", default=cpu)
        sibling_file = topo_dir / "thread_siblings_list"
        if sibling_file.is_file():
            listed = _parse_file_cpu_list(sibling_file)
        else:
            listed = [cpu]
        # Offline siblings cannot be used, and the CPU itself must be present even if sysfs disagrees.
        siblings = tuple(sorted({s for s in listed if s in online_set} | {cpu}))
        cpus.append(
            LogicalCpu(
                cpu=cpu,
                package=package,
                core=core,
                node=node_of.get(cpu, 0),
                siblings=siblings,
            )
        )
    return Topology(cpus=tuple(cpus))


def _online_cpus(cpu_root: Path) -> list[int]:
    """Return the online CPU ids from the online file, or from the cpuN directories if it is absent."""
    online_file = cpu_root / "online"
    if online_file.is_file():
        return _parse_file_cpu_list(online_file)
    if not cpu_root.is_dir():
        return []
    found: list[int] = []
    for entry in cpu_root.iterdir():
        match = _CPU_DIR_RE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def _cpu_nodes(node_root: Path) -> dict[int, int]:
    """Map each CPU id to its NUMA node using nodeK/cpulist files."""
    mapping: dict[int, int] = {}
    if not node_root.is_dir():
        return mapping
    for entry in sorted(node_root.iterdir()):
        match = _NODE_DIR_RE.fullmatch(entry.name)
        cpulist = entry / "cpulist"
        if match and cpulist.is_file():
            for cpu in _parse_file_cpu_list(cpulist):
                mapping[cpu] = int(match.group(1))
    return mapping


def _parse_file_cpu_list(path: Path) -> list[int]:
    """Parse a cpu list file, raising TopologyError that names the file on bad content."""
    try:
        return parse_cpu_list(path.read_text(encoding="ascii", errors="replace"))
    except (OSError, ValueError) as exc:
        raise TopologyError(f"cannot read cpu list from {path}: {exc}") from exc


def _read_int(path: Path, default: int) -> int:
    """Read an integer file, returning default if it does not exist."""
    if not path.is_file():
        return default
    try:
        # physical_package_id is -1 on some platforms, so negative values are accepted.
        return int(path.read_text(encoding="ascii", errors="replace").strip())
    except (OSError, ValueError) as exc:
        raise TopologyError(f"cannot read integer from {path}: {exc}") from exc
