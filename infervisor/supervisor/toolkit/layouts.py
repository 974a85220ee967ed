"""The worker layouts a box allows one model: workers x cores per worker, placed as the daemon would place them.

One 2-core worker and two 1-core workers are different trades (on a 2-core box eager ResNet-18
answered a sequential request in 31-33 ms from one 2-core worker and in 48-50 ms from a 1-core
one, while two 1-core workers served 38-40 req/s against 31-33), so `infervisor optimize` measures
every layout that fits, with the core planner the daemon uses, beside the config's other models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from infervisor.supervisor.host.planner import PlanError, WorkerDemand, plan_cores
from infervisor.supervisor.host.topology import Topology
from infervisor.supervisor.settings.config import Config


@dataclass(frozen=True, order=True)
class Layout:
    """How many workers a model runs and how many physical cores each gets (one thread per core)."""

    workers: int
    cores_per_worker: int

    def __str__(self) -> str:
        return f"{self.workers}x{self.cores_per_worker}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """`WxC` (workers x cores per worker); ValueError otherwise."""
        workers, _, cores = text.lower().partition("x")
        layout = cls(int(workers), int(cores))
        if layout.workers < 1 or layout.cores_per_worker < 1:
            raise ValueError(f"a layout needs at least one worker and one core: {text!r}")
        return layout


def _demands(config: Config, model: str, layout: Layout) -> list[WorkerDemand]:
    """The daemon's demands with `model` at `layout`, in config order (the planner places them in that order)."""
    demands = []
    for m in config.models.values():
        if m.name == model:
            demands.append(WorkerDemand(m.name, layout.workers, layout.cores_per_worker, m.use_smt, None))
        else:
            demands.append(WorkerDemand(m.name, m.workers, m.cores_per_worker, m.use_smt, m.threads))
    return demands


def placement(
    config: Config, model: str, layout: Layout, topology: Topology, allowed: Iterable[int]
) -> list[tuple[int, ...]]:
    """The CPUs of each of `model`'s workers at `layout`, beside the other models; PlanError when it does not fit.

    Always disjoint: an oversubscribed layout measures the neighbours' load, not the layout.
    """
    assignments = plan_cores(topology, allowed, _demands(config, model, layout), oversubscribe=False)
    return [a.cpus for a in assignments if a.model == model]


def layouts(
    config: Config, model: str, topology: Topology, allowed: Iterable[int], cores: Iterable[int] | None = None
) -> list[Layout]:
    """Every layout of `model` that fits beside the other models, fewest cores per worker first.

    `cores` restricts the cores per worker (optimize --threads).
    """
    allowed = sorted(allowed)
    physical = len([c for c in topology.physical_cores() if set(c) & set(allowed)])
    found: list[Layout] = []
    for per in sorted(set(cores) if cores is not None else range(1, physical + 1)):
        for workers in range(1, physical // per + 1):
            layout = Layout(workers, per)
            try:
                placement(config, model, layout, topology, allowed)
            except PlanError:
                break
            found.append(layout)
    return found


def with_layout(config: Config, model: str, layout: Layout) -> Config:
    """The config with `model` at `layout` (threads back to one per core)."""
    entry = replace(
        config.models[model], workers=layout.workers, cores_per_worker=layout.cores_per_worker, threads=None
    )
    return replace(config, models={**config.models, model: entry})
