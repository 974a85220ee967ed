"""Plan which logical CPUs each worker process is pinned to, one NUMA node per worker."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from infervisor.supervisor.host.topology import Topology, format_cpu_list

__all__ = [
    "Assignment",
    "PlanError",
    "WorkerDemand",
    "plan_cores",
    "usable_cpus",
]


class PlanError(Exception):
    """Raised when demands are invalid or cannot be placed on the usable cores."""


@dataclass(frozen=True)
class WorkerDemand:
    """How many workers a model wants and how many physical cores each one needs."""

    model: str
    workers: int
    cores_per_worker: int
    use_smt: bool
    threads: int | None


@dataclass(frozen=True)
class Assignment:
    """The CPUs one worker slot of a model is pinned to."""

    model: str
    slot: int
    cpus: tuple[int, ...]
    node: int
    threads: int
    shared: bool


@dataclass(frozen=True)
class _Core:
    """A physical core restricted to its allowed logical CPUs."""

    index: int
    node: int
    cpus: tuple[int, ...]


def usable_cpus(topology: Topology, allowed: Iterable[int]) -> list[int]:
    """Return the sorted CPUs that are both online in the topology and in the allowed set."""
    allowed_set = set(allowed)
    return [c for c in topology.cpu_ids() if c in allowed_set]


def plan_cores(
    topology: Topology,
    allowed: Iterable[int],
    demands: Sequence[WorkerDemand],
    oversubscribe: bool = False,
) -> list[Assignment]:
    """Assign each worker whole physical cores on one NUMA node, disjoint unless oversubscribe is set."""
    _validate(demands)
    allowed_set = set(allowed)
    cores = _usable_cores(topology, allowed_set)
    by_node: dict[int, list[_Core]] = {}
    for core in cores:
        by_node.setdefault(core.node, []).append(core)

    # load[i] counts the workers on core i; disjoint placement only takes cores with load 0.
    load = [0] * len(cores)
    # Per-node round-robin position, so oversubscribed workers start where the last one ended.
    cursor = {node: 0 for node in by_node}
    placed: list[tuple[WorkerDemand, int, list[_Core]]] = []

    for demand in demands:
        for slot in range(demand.workers):
            chosen = _place_disjoint(by_node, load, cursor, demand.cores_per_worker)
            if chosen is None:
                if not oversubscribe or not cores:
                    raise PlanError(_failure_message(topology, allowed_set, demands, by_node, load, demand, slot))
                chosen = _place_shared(by_node, load, cursor, demand.cores_per_worker)
            for core in chosen:
                load[core.index] += 1
            placed.append((demand, slot, chosen))

    assignments: list[Assignment] = []
    for demand, slot, chosen in placed:
        # Without SMT the lowest allowed thread stands in for the whole core; its sibling stays idle.
        cpus = tuple(sorted(c for core in chosen for c in (core.cpus if demand.use_smt else core.cpus[:1])))
        assignments.append(
            Assignment(
                model=demand.model,
                slot=slot,
                cpus=cpus,
                node=chosen[0].node,
                threads=demand.threads if demand.threads is not None else len(cpus),
                shared=False,
            )
        )
    return _mark_shared(assignments)


def _validate(demands: Sequence[WorkerDemand]) -> None:
    """Reject demands that no placement could satisfy meaningfully."""
    seen: set[str] = set()
    for demand in demands:
        if not demand.model:
            raise PlanError("demand has an empty model name")
        if demand.model in seen:
            # Slots are numbered per model, so two demands for one model would produce clashing slots.
            raise PlanError(f"model {demand.model!r} appears in more than one demand")
        seen.add(demand.model)
        if demand.workers < 1:
            raise PlanError(f"model {demand.model!r}: workers must be >= 1, got {demand.workers}")
        if demand.cores_per_worker < 1:
            raise PlanError(f"model {demand.model!r}: cores_per_worker must be >= 1, got {demand.cores_per_worker}")
        if demand.threads is not None and demand.threads < 1:
            raise PlanError(f"model {demand.model!r}: threads must be None or >= 1, got {demand.threads}")


def _usable_cores(topology: Topology, allowed: set[int]) -> list[_Core]:
    """Return the physical cores with at least one allowed CPU, ordered by their lowest allowed CPU."""
    node_of = {c.cpu: c.node for c in topology.cpus}
    restricted = [tuple(c for c in siblings if c in allowed) for siblings in topology.physical_cores()]
    ordered = sorted((cpus for cpus in restricted if cpus), key=lambda cpus: cpus[0])
    return [_Core(index=i, node=node_of[cpus[0]], cpus=cpus) for i, cpus in enumerate(ordered)]


def _free_count(node_cores: list[_Core], load: list[int]) -> int:
    """Count the cores of a node that no worker uses yet."""
    return sum(1 for core in node_cores if load[core.index] == 0)


def _place_disjoint(
    by_node: dict[int, list[_Core]], load: list[int], cursor: dict[int, int], count: int
) -> list[_Core] | None:
    """Take count free cores from the node with the most free cores, or return None if no node has enough."""
    best: int | None = None
    best_free = 0
    for node in sorted(by_node):
        free = _free_count(by_node[node], load)
        if free >= count and free > best_free:
            best, best_free = node, free
    if best is None:
        return None
    node_cores = by_node[best]
    chosen = [core for core in node_cores if load[core.index] == 0][:count]
    cursor[best] = node_cores.index(chosen[-1]) + 1
    return chosen


def _place_shared(by_node: dict[int, list[_Core]], load: list[int], cursor: dict[int, int], count: int) -> list[_Core]:
    """Take count consecutive cores round-robin on one node, reusing busy cores and preferring the emptiest node."""
    largest = max(len(cores) for cores in by_node.values())
    # A worker bigger than every node gets a whole largest node rather than spanning nodes.
    count = min(count, largest)
    candidates = [node for node in sorted(by_node) if len(by_node[node]) >= count]

    def pressure(node: int) -> tuple[int, Fraction, int]:
        node_cores = by_node[node]
        busy = sum(load[core.index] for core in node_cores)
        return (-_free_count(node_cores, load), Fraction(busy, len(node_cores)), node)

    node = min(candidates, key=pressure)
    node_cores = by_node[node]
    start = cursor[node] % len(node_cores)
    cursor[node] = start + count
    return [node_cores[(start + k) % len(node_cores)] for k in range(count)]


def _mark_shared(assignments: list[Assignment]) -> list[Assignment]:
    """Set shared on every assignment whose CPUs overlap another assignment's CPUs."""
    owners: dict[int, int] = {}
    for a in assignments:
        for cpu in a.cpus:
            owners[cpu] = owners.get(cpu, 0) + 1
    return [replace(a, shared=True) if any(owners[cpu] > 1 for cpu in a.cpus) else a for a in assignments]


def _failure_message(
    topology: Topology,
    allowed: set[int],
    demands: Sequence[WorkerDemand],
    by_node: dict[int, list[_Core]],
    load: list[int],
    demand: WorkerDemand,
    slot: int,
) -> str:
    """Explain why a worker did not fit and what the operator can change."""
    total = sum(d.workers * d.cores_per_worker for d in demands)
    usable = sum(len(cores) for cores in by_node.values())
    per_node = (
        ", ".join(
            f"node{node}: {_free_count(by_node[node], load)} free of {len(by_node[node])}" for node in sorted(by_node)
        )
        or "none"
    )
    in_topology = usable_cpus(topology, allowed)
    ignored = sorted(allowed - set(in_topology))
    ignored_note = f"; not online, ignored: {format_cpu_list(ignored)}" if ignored else ""
    return (
        f"cannot place worker {slot} of model {demand.model!r}: it needs "
        f"{demand.cores_per_worker} free physical cores on a single NUMA node "
        f"(physical cores per node: {per_node}). "
        f"Demands ask for {total} physical cores in total, {usable} physical cores are usable "
        f"(allowed cpus: {format_cpu_list(in_topology) or 'none'}{ignored_note}). "
        f"Use fewer workers or a smaller cores_per_worker, or enable oversubscribe to share cores."
    )
