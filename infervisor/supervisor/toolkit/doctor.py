"""`infervisor doctor`: seed 1's "why is it slow" checklist, grown to 14 checks, checked on this box against a config.

Each check reads the machine (sysfs, procfs, cgroup files, a torch probe in a child process) and
answers pass / warn / fail with the fix in one line. The sysfs and proc roots are parameters so
tests can point them at fake trees.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infervisor.common.cpuinfo import parse_cpuinfo
from infervisor.common.profiles import PROFILES, cpu_refusal
from infervisor.supervisor.host.cpu_latency import DEVICE as CPU_LATENCY_DEVICE
from infervisor.supervisor.host.planner import Assignment, PlanError, WorkerDemand, plan_cores
from infervisor.supervisor.host.topology import TopologyError, read_topology
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.toolkit.constraints import Constraints

#: What the supervisor itself and one idle worker's interpreter, torch and pools take before the model.
SUPERVISOR_MB = 60
WORKER_BASE_MB = 350
#: The torch range this daemon is built and tested against.
TORCH_RANGE = ((2, 13), (2, 14))


class Status(enum.Enum):
    """A check's verdict; FAIL makes the command exit non-zero."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class Machine:
    """Where the checks look (real roots by default, fake trees in tests)."""

    sysfs: Path = Path("/sys")
    proc: Path = Path("/proc")
    allowed_cpus: set[int] = field(default_factory=lambda: set(os.sched_getaffinity(0)))
    cpu_latency_device: Path = CPU_LATENCY_DEVICE
    #: Runs the torch probe; returns its JSON, or raises OSError/ValueError.
    torch_probe: Callable[[], dict[str, object]] | None = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cache_sizes(machine: Machine) -> str:
    """The first CPU's caches from sysfs, e.g. `L1d 48K, L1i 32K, L2 1024K, L3 32768K` (empty when not exposed)."""
    parts = []
    for index in sorted((machine.sysfs / "devices/system/cpu/cpu0/cache").glob("index*")):
        level, kind, size = (_read(index / name) for name in ("level", "type", "size"))
        if level and size:
            suffix = {"Data": "d", "Instruction": "i"}.get(kind or "", "")
            parts.append(f"L{level}{suffix} {size}")
    return ", ".join(parts)


def check_instruction_set(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """The CPU's tier against every profile the config's chains name."""
    caps = parse_cpuinfo(_read(machine.proc / "cpuinfo") or "")
    refused = sorted(
        {f"{p} ({cpu_refusal(p, caps)})" for m in config.models.values() for p in m.profiles if cpu_refusal(p, caps)}
    )
    where = f"{caps.model_name}, tier {caps.tier}, flags {' '.join(sorted(caps.flags)) or 'none'}"
    caches = cache_sizes(machine)
    where += f", caches {caches}" if caches else ""
    if constraints and constraints.hardware.cpu_model and constraints.hardware.cpu_model != caps.model_name:
        return Check(
            "instruction set", Status.WARN, f"{where}; the constraints name {constraints.hardware.cpu_model!r}",
            "measure on the target box: figures from another CPU model do not carry over",
        )  # fmt: skip
    if refused:
        return Check(
            "instruction set", Status.WARN, f"{where}; these profiles will be skipped here: {'; '.join(refused)}",
            "drop them from `profiles`, or keep them as fallbacks that cost a few seconds at start",
        )  # fmt: skip
    return Check("instruction set", Status.PASS, where)


def check_torch_version(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """The installed torch is the one the daemon is tested with (read from metadata, not imported)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return Check("torch version", Status.FAIL, "torch is not installed", "pip install torch==2.13.0 (CPU wheel)")
    major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    low, high = TORCH_RANGE
    if not low <= major_minor < high:
        return Check("torch version", Status.FAIL, f"torch {version}", "pip install torch==2.13.0 (CPU wheel)")
    if "+cpu" not in version:
        return Check(
            "torch version", Status.WARN, f"torch {version} (not the +cpu wheel)",
            "pip install torch==2.13.0 from the CPU index: the CUDA build is GBs larger and starts slower",
        )  # fmt: skip
    return Check("torch version", Status.PASS, f"torch {version}")


def check_contiguous_inputs(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """Inputs reach the model as C-contiguous frames by construction of the wire format."""
    return Check(
        "contiguous inputs", Status.PASS,
        "the protocol carries C-contiguous little-endian frames; workers view them without a copy",
    )  # fmt: skip


def _torch_probe() -> dict[str, object]:
    code = (
        "import json, torch; print(json.dumps({'mkldnn': torch.backends.mkldnn.is_available(), "
        "'capability': torch.backends.cpu.get_cpu_capability(), 'openmp': torch.backends.openmp.is_available()}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise OSError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_onednn(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """oneDNN (MKLDNN) and OpenMP are present in this torch build, and what it dispatches to."""
    try:
        probe = (machine.torch_probe or _torch_probe)()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return Check("oneDNN", Status.FAIL, f"torch could not be probed: {exc}", "reinstall torch==2.13.0")
    if not probe.get("mkldnn") or not probe.get("openmp"):
        return Check("oneDNN", Status.FAIL, f"mkldnn {probe.get('mkldnn')}, openmp {probe.get('openmp')}",
                     "install the official CPU wheel: this build lacks oneDNN or OpenMP")  # fmt: skip
    return Check("oneDNN", Status.PASS, f"oneDNN and OpenMP present; kernels dispatch to {probe.get('capability')}")


def _plan(config: Config, machine: Machine) -> tuple[list[Assignment], str | None]:
    demands = [
        WorkerDemand(m.name, m.workers, m.cores_per_worker, m.use_smt, m.threads) for m in config.models.values()
    ]
    try:
        topology = read_topology(machine.sysfs)
        return list(plan_cores(topology, machine.allowed_cpus, demands, config.oversubscribe)), None
    except (PlanError, TopologyError) as exc:
        return [], str(exc)


def check_threads(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """Every worker gets its own cores inside the cpuset; thread pools are sized to them at exec."""
    assignments, problem = _plan(config, machine)
    if problem is not None:
        return Check("threads vs cpuset", Status.FAIL, problem,
                     "lower `workers` or `cores_per_worker`, or widen the cpuset (CPUAffinity=)")  # fmt: skip
    shared = [a for a in assignments if a.shared]
    detail = f"{len(assignments)} worker(s) planned on cpus {sorted(machine.allowed_cpus)}"
    if shared:
        return Check("threads vs cpuset", Status.WARN, f"{detail}; {len(shared)} share cores (oversubscribe)",
                     "shared cores make latency depend on the neighbour: size the pools to the cores")  # fmt: skip
    return Check("threads vs cpuset", Status.PASS, f"{detail}, disjoint; OMP/MKL threads set per worker at exec")


def check_eval_mode(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """Loaded models are put in eval() and run under inference_mode by the worker itself."""
    return Check("eval + inference mode", Status.PASS, "every model is put in eval(); forwards run in inference_mode")


def check_governor(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """The frequency governor of the allowed CPUs: `performance` keeps P99 from riding the clock."""
    governors: dict[str, list[int]] = {}
    for cpu in sorted(machine.allowed_cpus):
        value = _read(machine.sysfs / f"devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor")
        if value is not None:
            governors.setdefault(value, []).append(cpu)
    may_change = constraints is None or constraints.operations.kernel_params_changeable
    if not governors:
        mhz = sorted({line.partition(":")[2].strip() for line in (_read(machine.proc / "cpuinfo") or "").splitlines()
                      if line.startswith("cpu MHz")})  # fmt: skip
        clock = f"; /proc/cpuinfo reports {', '.join(mhz)} MHz" if mhz else ""
        return Check("CPU governor", Status.WARN, f"cpufreq is not exposed (a VM or a locked BIOS){clock}",
                     "check the host's or BIOS's power profile: clock changes cannot be seen from here")  # fmt: skip
    slow = {g: c for g, c in governors.items() if g != "performance"}
    detail = ", ".join(f"{g} on {c}" for g, c in governors.items())
    current = [
        _read(machine.sysfs / f"devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq") for c in machine.allowed_cpus
    ]
    khz = [int(v) for v in current if v and v.isdigit()]
    detail += f"; now {min(khz) // 1000}-{max(khz) // 1000} MHz" if khz else ""
    if slow:
        fix = ("cpupower frequency-set -g performance" if may_change
               else "the constraints forbid kernel changes: ask the site to set the performance governor")  # fmt: skip
        return Check("CPU governor", Status.WARN, detail, fix)
    return Check("CPU governor", Status.PASS, detail)


def check_smt(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """SMT siblings: the planner pins one thread per physical core unless a model sets use_smt."""
    try:
        topology = read_topology(machine.sysfs)
    except TopologyError as exc:
        return Check("SMT", Status.WARN, f"topology unreadable: {exc}", "check /sys/devices/system/cpu")
    smt = any(len(core) > 1 for core in topology.physical_cores())
    smt_models = [m.name for m in config.models.values() if m.use_smt]
    if smt and smt_models:
        return Check("SMT", Status.WARN, f"SMT on; {', '.join(smt_models)} use siblings",
                     "siblings share a core's vector units: use_smt false for compute-bound models")  # fmt: skip
    return Check("SMT", Status.PASS, "SMT " + ("on; workers take one thread per physical core" if smt else "off"))


def check_numa(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """Each worker's cores on one NUMA node (the planner guarantees it, or refuses)."""
    try:
        nodes = read_topology(machine.sysfs).nodes()
    except TopologyError as exc:
        return Check("NUMA", Status.WARN, f"topology unreadable: {exc}", "check /sys/devices/system/node")
    assignments, problem = _plan(config, machine)
    if problem is not None:
        return Check("NUMA", Status.FAIL, problem, "fit each worker's cores within one node")
    spread = {a.node for a in assignments}
    return Check("NUMA", Status.PASS, f"{len(nodes)} node(s); workers on node(s) {sorted(spread)}, none spans two")


def _meminfo_mb(machine: Machine, key: str) -> int | None:
    for line in (_read(machine.proc / "meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        if name == key and rest.split():
            return int(rest.split()[0]) // 1024
    return None


def check_memory(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """Workers' expected memory against what the target box has (constraints) and what this one has free."""
    need = SUPERVISOR_MB + sum(
        m.workers * (m.rss_hard_mb or m.max_memory_mb or WORKER_BASE_MB * 2) for m in config.models.values()
    )
    available = _meminfo_mb(machine, "MemAvailable")
    budget = constraints.hardware.memory_mb if constraints else available
    detail = f"about {need} MB needed (rss_hard_mb or max_memory_mb per worker, else {WORKER_BASE_MB * 2} MB)"
    detail += f"; {available} MB available here" if available is not None else "; MemAvailable unreadable"
    if constraints:
        detail += f"; the target has {constraints.hardware.memory_mb} MB"
    if budget is not None and need > budget:
        fix = "fewer workers, a smaller profile (int8 weights are 4x smaller), or a box with more memory"
        return Check("memory headroom", Status.FAIL, detail, fix)
    if budget is not None and need > 0.8 * budget:
        return Check("memory headroom", Status.WARN, detail, "less than 20% headroom: set rss_hard_mb per model")
    return Check("memory headroom", Status.PASS, detail)


def _cgroup_quotas(machine: Machine) -> list[float]:
    """CPU quotas (in CPUs) on the path from this process's cgroup to the root: v2 cpu.max and v1 cfs files."""
    quotas: list[float] = []
    for line in (_read(machine.proc / "self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        files: tuple[str, ...]
        if controllers == "":
            root, files = machine.sysfs / "fs/cgroup", ("cpu.max",)
        elif "cpu" in controllers.split(","):
            root, files = machine.sysfs / "fs/cgroup" / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        folder = root / path.strip("/")
        while root == folder or root in folder.parents:
            values = [_read(folder / f) for f in files]
            if len(files) == 1 and values[0] and not values[0].startswith("max"):
                quota, _, period = values[0].partition(" ")
                quotas.append(int(quota) / int(period or "100000"))
            elif len(files) == 2 and values[0] and values[1] and int(values[0]) > 0:
                quotas.append(int(values[0]) / int(values[1]))
            if folder == root:
                break
            folder = folder.parent
    return quotas


def check_cgroup_cpu(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """A container CPU quota must be a whole number of CPUs, at least the cores the workers are pinned to."""
    quotas = _cgroup_quotas(machine)
    if not quotas:
        return Check("cgroup CPU limit", Status.PASS, "no CPU quota on this process's cgroup path (v1 or v2)")
    cpus = min(quotas)
    planned = len({c for a in _plan(config, machine)[0] for c in a.cpus})
    detail = f"quota {cpus:g} CPUs, {planned} cpus planned for workers"
    if cpus < planned:
        fix = "raise the limit to the planned cores, or plan fewer: a quota below them throttles every worker"
        return Check("cgroup CPU limit", Status.FAIL, detail, fix)
    if cpus != int(cpus):
        return Check("cgroup CPU limit", Status.WARN, detail,
                     "use a whole number of CPUs, equal to requests: fractional quotas throttle in bursts")  # fmt: skip
    return Check("cgroup CPU limit", Status.PASS, detail)


def check_affinity(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """The process may set CPU affinity (workers pin themselves; no capability is needed inside the cpuset)."""
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(0))
    except OSError as exc:
        return Check("affinity", Status.FAIL, f"sched_setaffinity refused: {exc}",
                     "allow sched_setaffinity (seccomp profile, container runtime)")  # fmt: skip
    return Check("affinity", Status.PASS, "sched_setaffinity allowed")


def check_cpu_latency(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """A `cpu_latency_us` request needs the kernel's CPU latency interface, writable by the daemon's user."""
    wanted, device = config.cpu_latency_us, machine.cpu_latency_device
    name, unit = "CPU wake latency", "under the shipped unit install systemd/cpu-latency.conf and its udev rule"
    if wanted is None:
        return Check(name, Status.PASS, "no cpu_latency_us request: idle CPUs sleep as deep as they like")
    if not device.exists():
        return Check(name, Status.FAIL, f"cpu_latency_us {wanted} asked, but there is no {device}",
                     f"{unit}; a kernel without it cannot hold the request: drop cpu_latency_us")  # fmt: skip
    if not os.access(device, os.W_OK):
        return Check(name, Status.FAIL, f"cpu_latency_us {wanted} asked; {device} is not writable by this user",
                     f"{unit}, or run the daemon as root; or drop cpu_latency_us")  # fmt: skip
    if os.geteuid() == 0:
        # Root may write anything: this says nothing of the dynamic user the shipped unit runs the daemon as.
        return Check(name, Status.PASS, f"{device} writable (checked as root): idle CPUs will wake within {wanted} us",
                     unit)  # fmt: skip
    return Check(name, Status.PASS, f"{device} writable: idle CPUs will wake within {wanted} us")


def check_accuracy_data(config: Config, constraints: Constraints | None, machine: Machine) -> Check:
    """A chain with a profile that changes numerics (int8, bf16) needs real inputs to be judged on."""
    synthetic = {
        name: [p for p in m.profiles if PROFILES[p].changes_numerics]
        for name, m in config.models.items()
        if m.validation is None
    }
    named = "; ".join(f"{name}: {', '.join(profiles)}" for name, profiles in synthetic.items() if profiles)
    if named:
        return Check(
            "accuracy data", Status.WARN,
            f"profiles that change numerics would be judged on synthetic inputs only (no validation set): {named}",
            "configure `validation` for these models: an .npz of real inputs every profile is checked on",
        )  # fmt: skip
    judged = [name for name, m in config.models.items() if m.validation is not None]
    detail = f"validation sets: {', '.join(judged)}" if judged else "no chain has a profile that changes numerics"
    return Check("accuracy data", Status.PASS, detail)


CHECKS = (
    check_instruction_set, check_torch_version, check_contiguous_inputs, check_onednn, check_threads,
    check_eval_mode, check_governor, check_smt, check_numa, check_memory, check_cgroup_cpu, check_affinity,
    check_cpu_latency, check_accuracy_data,
)  # fmt: skip


def run_checks(config: Config, constraints: Constraints | None, machine: Machine | None = None) -> list[Check]:
    """Every check, in the seed's order."""
    machine = machine or Machine()
    return [check(config, constraints, machine) for check in CHECKS]
