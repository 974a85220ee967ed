"""Tests for the sysfs topology reader and the core planner."""

import os
import shutil
from pathlib import Path

import pytest

from infervisor.supervisor.host.planner import (
    Assignment,
    PlanError,
    WorkerDemand,
    plan_cores,
    usable_cpus,
)
from infervisor.supervisor.host.topology import (
    LogicalCpu,
    Topology,
    TopologyError,
    format_cpu_list,
    parse_cpu_list,
    read_topology,
)


def make_sysfs(
    tmp_path: Path,
    packages: int,
    cores_per_package: int,
    threads_per_core: int,
    nodes_per_package: int = 1,
) -> Path:
    """Write a fake sysfs tree numbered like Linux on Intel (first threads, then siblings); return its root."""
    assert cores_per_package % nodes_per_package == 0
    root = tmp_path / "sys"
    cpu_root = root / "devices" / "system" / "cpu"
    node_root = root / "devices" / "system" / "node"
    cores_total = packages * cores_per_package
    cores_per_node = cores_per_package // nodes_per_package
    node_cpus: dict[int, list[int]] = {}
    for thread in range(threads_per_core):
        for package in range(packages):
            for core in range(cores_per_package):
                cpu = thread * cores_total + package * cores_per_package + core
                first = package * cores_per_package + core
                siblings = [first + t * cores_total for t in range(threads_per_core)]
                topo = cpu_root / f"cpu{cpu}" / "topology"
                topo.mkdir(parents=True)
                (topo / "physical_package_id").write_text(f"{package}\n")
                (topo / "core_id").write_text(f"{core}\n")
                (topo / "thread_siblings_list").write_text(format_cpu_list(siblings) + "\n")
                node = package * nodes_per_package + core // cores_per_node
                node_cpus.setdefault(node, []).append(cpu)
    (cpu_root / "online").write_text(f"0-{cores_total * threads_per_core - 1}\n")
    for node, cpus in node_cpus.items():
        (node_root / f"node{node}").mkdir(parents=True)
        (node_root / f"node{node}" / "cpulist").write_text(format_cpu_list(cpus) + "\n")
    return root


@pytest.fixture
def small(tmp_path: Path) -> Topology:
    """One socket with two cores and no SMT."""
    return read_topology(make_sysfs(tmp_path, 1, 2, 1))


@pytest.fixture
def dual(tmp_path: Path) -> Topology:
    """Two sockets with 14 hyperthreaded cores each, one NUMA node per socket."""
    return read_topology(make_sysfs(tmp_path, 2, 14, 2))


def demand(
    workers: int,
    cores: int,
    use_smt: bool = False,
    threads: int | None = None,
    model: str = "m",
) -> WorkerDemand:
    """Build a WorkerDemand with short positional arguments."""
    return WorkerDemand(
        model=model,
        workers=workers,
        cores_per_worker=cores,
        use_smt=use_smt,
        threads=threads,
    )


def all_cpus(topology: Topology) -> list[int]:
    """Return every cpu id of the topology."""
    return topology.cpu_ids()


def assert_disjoint(plan: list[Assignment]) -> None:
    """Fail if any cpu is given to two assignments."""
    seen: set[int] = set()
    for a in plan:
        assert seen.isdisjoint(a.cpus), f"{a} overlaps earlier assignments"
        seen.update(a.cpus)


def assert_single_node(topology: Topology, plan: list[Assignment]) -> None:
    """Fail if an assignment's cpus are not all on its reported node."""
    for a in plan:
        assert {topology.cpu(c).node for c in a.cpus} == {a.node}


# --- cpu list parsing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
        ("0\n", [0]),
        ("", []),
        ("  \n", []),
        ("5,1-2", [1, 2, 5]),
        ("3-3", [3]),
    ],
)
def test_parse_cpu_list(text: str, expected: list[int]) -> None:
    """parse_cpu_list expands ranges and single ids into a sorted list."""
    assert parse_cpu_list(text) == expected


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "1,,2", "1-2-3", "0x1", "1.5", "1;2", "١"])
def test_parse_cpu_list_rejects_malformed(text: str) -> None:
    """parse_cpu_list raises ValueError naming the offending list for malformed input."""
    with pytest.raises(ValueError, match="invalid cpu list"):
        parse_cpu_list(text)


@pytest.mark.parametrize(
    "cpus",
    [[], [0], [0, 1], [0, 1, 2, 3, 8, 10, 11], [1, 2, 5, 30, 31], list(range(56))],
)
def test_cpu_list_round_trip(cpus: list[int]) -> None:
    """format_cpu_list output parses back to the same cpus."""
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_format_cpu_list_is_compact() -> None:
    """format_cpu_list merges consecutive ids into ranges regardless of input order or duplicates."""
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10, 3]) == "0-3,8,10-11"
    assert format_cpu_list([]) == ""


def test_format_cpu_list_rejects_negative() -> None:
    """format_cpu_list refuses negative cpu ids."""
    with pytest.raises(ValueError):
        format_cpu_list([-1, 0])


# --- topology reading -------------------------------------------------------------------


def test_read_topology_dual_socket_numbering(dual: Topology) -> None:
    """The fake 2x14 HT tree reads back with Intel-style package, core, sibling and node numbering."""
    assert all_cpus(dual) == list(range(56))
    assert dual.cpu(0) == LogicalCpu(cpu=0, package=0, core=0, node=0, siblings=(0, 28))
    assert dual.cpu(14) == LogicalCpu(cpu=14, package=1, core=0, node=1, siblings=(14, 42))
    assert dual.cpu(41) == LogicalCpu(cpu=41, package=0, core=13, node=0, siblings=(13, 41))
    assert dual.nodes() == [0, 1]
    assert dual.cpus_on_node(1) == list(range(14, 28)) + list(range(42, 56))
    cores = dual.physical_cores()
    assert len(cores) == 28
    assert cores[0] == (0, 28) and cores[27] == (27, 55)


def test_read_topology_missing_topology_dir(tmp_path: Path) -> None:
    """A cpu without a topology dir is treated as its own core in package 0."""
    root = make_sysfs(tmp_path, 1, 2, 2)
    shutil.rmtree(root / "devices" / "system" / "cpu" / "cpu3" / "topology")
    topo = read_topology(root)
    cpu3 = topo.cpu(3)
    assert (cpu3.package, cpu3.core, cpu3.siblings) == (0, 3, (3,))
    # cpu1 still lists cpu3 as its sibling, which is what the kernel file says.
    assert topo.cpu(1).siblings == (1, 3)


def test_read_topology_without_online_or_node_dirs(tmp_path: Path) -> None:
    """Without an online file every cpuN dir is used, and without node dirs every cpu is on node 0."""
    root = make_sysfs(tmp_path, 2, 2, 1, nodes_per_package=1)
    (root / "devices" / "system" / "cpu" / "online").unlink()
    (root / "devices" / "system" / "cpu" / "cpufreq").mkdir()
    shutil.rmtree(root / "devices" / "system" / "node")
    topo = read_topology(root)
    assert all_cpus(topo) == [0, 1, 2, 3]
    assert topo.nodes() == [0]
    assert [c.package for c in topo.cpus] == [0, 0, 1, 1]


def test_read_topology_only_online_cpus(tmp_path: Path) -> None:
    """Offline cpus are left out and dropped from their siblings' lists."""
    root = make_sysfs(tmp_path, 1, 4, 2)
    (root / "devices" / "system" / "cpu" / "online").write_text("0-5\n")
    topo = read_topology(root)
    assert all_cpus(topo) == [0, 1, 2, 3, 4, 5]
    assert topo.cpu(0).siblings == (0, 4)
    assert topo.cpu(2).siblings == (2,)


def test_read_topology_no_cpus(tmp_path: Path) -> None:
    """An empty sysfs tree raises TopologyError naming the directory it looked in."""
    with pytest.raises(TopologyError, match="no CPUs found"):
        read_topology(tmp_path)


def test_read_topology_bad_file(tmp_path: Path) -> None:
    """Garbage in a topology file raises TopologyError naming the file."""
    root = make_sysfs(tmp_path, 1, 2, 1)
    (root / "devices" / "system" / "cpu" / "cpu1" / "topology" / "core_id").write_text("x\n")
    with pytest.raises(TopologyError, match="core_id"):
        read_topology(root)


def test_read_real_sysfs() -> None:
    """Reading this machine's /sys yields at least one cpu, and a one-core plan fits in our affinity."""
    topo = read_topology()
    assert len(topo.cpus) >= 1
    assert all(c.cpu in c.siblings for c in topo.cpus)
    plan = plan_cores(topo, os.sched_getaffinity(0), [demand(1, 1)])
    assert len(plan) == 1 and len(plan[0].cpus) == 1


# --- planner: small machine -------------------------------------------------------------


def test_two_single_core_workers(small: Topology) -> None:
    """Two one-core workers on a two-core machine get disjoint cpus 0 and 1."""
    plan = plan_cores(small, {0, 1}, [demand(2, 1)])
    assert plan == [
        Assignment(model="m", slot=0, cpus=(0,), node=0, threads=1, shared=False),
        Assignment(model="m", slot=1, cpus=(1,), node=0, threads=1, shared=False),
    ]


def test_three_workers_on_two_cores_fail(small: Topology) -> None:
    """A third worker on a two-core machine raises PlanError stating the asked and usable counts."""
    with pytest.raises(PlanError) as info:
        plan_cores(small, {0, 1}, [demand(3, 1)])
    message = str(info.value)
    assert "3 physical cores in total" in message
    assert "2 physical cores are usable" in message
    assert "allowed cpus: 0-1" in message
    assert "oversubscribe" in message


def test_three_workers_oversubscribed(small: Topology) -> None:
    """With oversubscribe the third worker wraps onto cpu 0 and both users of cpu 0 are marked shared."""
    plan = plan_cores(small, {0, 1}, [demand(3, 1)], oversubscribe=True)
    assert [(a.slot, a.cpus, a.shared) for a in plan] == [
        (0, (0,), True),
        (1, (1,), False),
        (2, (0,), True),
    ]


def test_oversubscribe_round_robin(small: Topology) -> None:
    """Further oversubscribed workers keep cycling over the cores so the load stays even."""
    plan = plan_cores(small, {0, 1}, [demand(6, 1)], oversubscribe=True)
    assert [a.cpus for a in plan] == [(0,), (1,), (0,), (1,), (0,), (1,)]
    assert all(a.shared for a in plan)


# --- planner: dual socket with hyperthreading -------------------------------------------


def test_four_workers_seven_cores_no_smt(dual: Topology) -> None:
    """Four 7-core workers alternate between the nodes, are disjoint and use one thread per core."""
    plan = plan_cores(dual, all_cpus(dual), [demand(4, 7)])
    assert [a.cpus for a in plan] == [
        tuple(range(7)),
        tuple(range(14, 21)),
        tuple(range(7, 14)),
        tuple(range(21, 28)),
    ]
    assert [a.node for a in plan] == [0, 1, 0, 1]
    assert all(a.threads == 7 and not a.shared for a in plan)
    assert_disjoint(plan)
    assert_single_node(dual, plan)


def test_four_workers_seven_cores_with_smt(dual: Topology) -> None:
    """With use_smt every worker also gets the hyperthread siblings of its 7 cores."""
    plan = plan_cores(dual, all_cpus(dual), [demand(4, 7, use_smt=True)])
    assert plan[0].cpus == tuple(range(7)) + tuple(range(28, 35))
    assert plan[1].cpus == tuple(range(14, 21)) + tuple(range(42, 49))
    for a in plan:
        assert len(a.cpus) == 14 and a.threads == 14
        assert all(dual.cpu(c).siblings[0] in a.cpus for c in a.cpus)
    assert_disjoint(plan)
    assert_single_node(dual, plan)
    assert sorted(c for a in plan for c in a.cpus) == list(range(56))


def test_eight_core_workers_never_span_nodes(dual: Topology) -> None:
    """Two 8-core workers each stay inside one 14-core node, and a third one does not fit."""
    plan = plan_cores(dual, all_cpus(dual), [demand(2, 8)])
    assert [a.node for a in plan] == [0, 1]
    assert_single_node(dual, plan)
    assert_disjoint(plan)
    # 12 cores are still free in total, but only 6 per node.
    with pytest.raises(PlanError, match="node0: 6 free of 14, node1: 6 free of 14"):
        plan_cores(dual, all_cpus(dual), [demand(3, 8)])


def test_two_full_node_workers(dual: Topology) -> None:
    """Two 14-core SMT workers take one whole node each."""
    plan = plan_cores(dual, all_cpus(dual), [demand(2, 14, use_smt=True)])
    assert [a.cpus for a in plan] == [
        tuple(dual.cpus_on_node(0)),
        tuple(dual.cpus_on_node(1)),
    ]
    assert_disjoint(plan)


def test_worker_larger_than_node_fails(dual: Topology) -> None:
    """A 15-core worker cannot fit on a 14-core node even though 28 cores are usable."""
    with pytest.raises(PlanError, match="15 physical cores in total, 28 physical cores are usable"):
        plan_cores(dual, all_cpus(dual), [demand(1, 15)])


def test_worker_larger_than_node_oversubscribed(dual: Topology) -> None:
    """With oversubscribe an oversized worker gets the whole largest node instead of spanning nodes."""
    plan = plan_cores(dual, all_cpus(dual), [demand(1, 15)], oversubscribe=True)
    assert plan[0].cpus == tuple(range(14)) and plan[0].threads == 14
    assert_single_node(dual, plan)


def test_demands_fill_in_order(dual: Topology) -> None:
    """Later demands use the cores left over by earlier ones, with slots numbered per model."""
    plan = plan_cores(dual, all_cpus(dual), [demand(1, 10, model="big"), demand(3, 4, model="small")])
    assert [(a.model, a.slot, a.node) for a in plan] == [
        ("big", 0, 0),
        ("small", 0, 1),
        ("small", 1, 1),
        ("small", 2, 1),
    ]
    assert plan[0].cpus == tuple(range(10))
    assert plan[1].cpus == tuple(range(14, 18))
    assert_disjoint(plan)


def test_oversubscribe_spreads_over_nodes(dual: Topology) -> None:
    """Oversubscribed workers are spread over both nodes and only overlapping ones are shared."""
    plan = plan_cores(dual, all_cpus(dual), [demand(3, 14)], oversubscribe=True)
    assert [a.node for a in plan] == [0, 1, 0]
    assert [a.shared for a in plan] == [True, False, True]
    assert_single_node(dual, plan)


# --- planner: restricted affinity -------------------------------------------------------


def test_odd_cpuset_only_uses_allowed(dual: Topology) -> None:
    """With allowed={1,2,5,30,31} only those cpus are ever handed out."""
    allowed = {1, 2, 5, 30, 31}
    assert usable_cpus(dual, allowed | {99}) == [1, 2, 5, 30, 31]
    no_smt = plan_cores(dual, allowed, [demand(4, 1)])
    assert [a.cpus for a in no_smt] == [(1,), (2,), (5,), (31,)]
    smt = plan_cores(dual, allowed, [demand(1, 4, use_smt=True)])
    assert smt[0].cpus == (1, 2, 5, 30, 31) and smt[0].threads == 5
    mixed = plan_cores(dual, allowed, [demand(2, 2, use_smt=True)], oversubscribe=True)
    for plan in (no_smt, smt, mixed):
        assert {c for a in plan for c in a.cpus} <= allowed
        assert_single_node(dual, plan)


def test_odd_cpuset_too_small(dual: Topology) -> None:
    """A demand for more cores than the odd cpuset holds fails and names the allowed cpus."""
    with pytest.raises(PlanError) as info:
        plan_cores(dual, {1, 2, 5, 30, 31, 99}, [demand(5, 1)])
    message = str(info.value)
    assert "5 physical cores in total, 4 physical cores are usable" in message
    assert "allowed cpus: 1-2,5,30-31" in message
    assert "not online, ignored: 99" in message


def test_nothing_allowed(dual: Topology) -> None:
    """An affinity mask with no online cpu fails even with oversubscribe."""
    with pytest.raises(PlanError, match="allowed cpus: none"):
        plan_cores(dual, {200}, [demand(1, 1)], oversubscribe=True)


# --- planner: threads and validation ----------------------------------------------------


def test_explicit_threads_override(dual: Topology) -> None:
    """An explicit thread count is used instead of the number of cpus."""
    plan = plan_cores(dual, all_cpus(dual), [demand(2, 4, use_smt=True, threads=3)])
    assert [(len(a.cpus), a.threads) for a in plan] == [(8, 3), (8, 3)]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (demand(0, 1), "workers must be >= 1"),
        (demand(1, 0), "cores_per_worker must be >= 1"),
        (demand(1, 1, threads=0), "threads must be None or >= 1"),
        (demand(1, 1, model=""), "empty model name"),
    ],
)
def test_invalid_demands(small: Topology, bad: WorkerDemand, match: str) -> None:
    """Invalid demands raise PlanError rather than tripping an assert."""
    with pytest.raises(PlanError, match=match):
        plan_cores(small, {0, 1}, [bad])


def test_duplicate_model_rejected(small: Topology) -> None:
    """Two demands for the same model are rejected because their slot numbers would clash."""
    with pytest.raises(PlanError, match="more than one demand"):
        plan_cores(small, {0, 1}, [demand(1, 1), demand(1, 1)])


def test_no_demands(small: Topology) -> None:
    """An empty demand list yields an empty plan."""
    assert plan_cores(small, {0, 1}, []) == []
