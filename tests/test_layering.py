"""The package layering declared as import-linter contracts in pyproject.toml holds, and the check catches a breach."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infervisor.supervisor import cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "common", "supervisor", "worker", "gateway")
#: import-linter's own command line, run by this interpreter so the venv's import-linter and grimp are used.
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run the contracts of `root`/pyproject.toml on the packages under `root` (a fresh process: grimp finds
    packages through the import system, and this one has the repository's already imported)."""
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )


def copy_of_the_tree(destination: Path) -> Path:
    """The `infervisor` package with its five subpackages and pyproject.toml, copied so one module can be broken
    without touching the repository; returns the copy's `infervisor` folder."""
    package_root = destination / "infervisor"
    package_root.mkdir()
    shutil.copy(ROOT / "infervisor" / "__init__.py", package_root / "__init__.py")
    for package in PACKAGES:
        source = ROOT / "infervisor" / package
        shutil.copytree(source, package_root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", destination / "pyproject.toml")
    return package_root


def add_line_after_future_import(module: Path, line: str) -> None:
    """Put `line` right after the module's `from __future__` import, where a real import would go."""
    text = module.read_text()
    anchor = "from __future__ import annotations\n"
    if anchor not in text:
        raise ValueError(f"{module} has no `from __future__ import annotations` line")
    module.write_text(text.replace(anchor, anchor + line + "\n", 1))


def test_the_packages_keep_their_layering() -> None:
    """protocol, common, supervisor, worker and gateway import only what the contracts allow, lazy imports included."""
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 5 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "offence"),
    [
        (
            "supervisor/commands/serve.py",
            "import infervisor.worker",
            "infervisor.supervisor.commands.serve -> infervisor.worker",
        ),
        (
            "supervisor/toolkit/doctor.py",
            "def _probe() -> object:\n    import torch\n\n    return torch",
            "infervisor.supervisor.toolkit.doctor -> torch",
        ),
        (
            "protocol/launch.py",
            "import infervisor.common.profiles",
            "infervisor.protocol.launch -> infervisor.common.profiles",
        ),
    ],
)
def test_a_forbidden_import_breaks_the_layering_and_is_named(
    tmp_path: Path, module: str, line: str, offence: str
) -> None:
    """One forbidden import added to a copy of the tree (a lazy one too) fails the check, which names the import."""
    package_root = copy_of_the_tree(tmp_path)
    add_line_after_future_import(package_root / module, line)
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert offence in done.stdout, done.stdout
    assert "Contracts: 4 kept, 1 broken." in done.stdout


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` imports by absolute name, lazy and TYPE_CHECKING imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith(f"{package}.")}


def up_arrows(folder: Path, package: str) -> list[str]:
    """Imports that point up or across: the core importing the toolkit or the CLI, the toolkit the CLI or the core
    (the two stand side by side: a tool reaches a daemon through the control client, infervisor/protocol/)."""
    cli_side = (f"{package}.commands", f"{package}.cli", f"{package}.__main__")
    offences = []
    for path in sorted(folder.rglob("*.py")):
        part = path.relative_to(folder).parts[0].removesuffix(".py")
        if part in ("commands", "cli", "__main__"):
            continue
        above = (*cli_side, f"{package}.core") if part == "toolkit" else (*cli_side, f"{package}.toolkit")
        offences += [f"{path.relative_to(folder)} -> {name}" for name in _imported_modules(path, package)
                     if any(name == up or name.startswith(f"{up}.") for up in above)]  # fmt: skip
    return offences


def test_the_daemon_core_and_the_toolkit_never_import_the_cli_or_each_other() -> None:
    """No arrow points up or across: the core imports neither the toolkit nor the CLI, the toolkit neither the CLI
    nor the core."""
    assert up_arrows(Path(cli.__file__).resolve().parent, cli.__name__.removesuffix(".cli")) == []


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("toolkit/check.py", "from infervisor.supervisor.commands.infer import summarize"),
        ("toolkit/scratch.py", "from infervisor.supervisor.core.control import ControlServer"),
        ("core/arbiter.py", "from infervisor.supervisor import cli"),
        ("observe/status.py", "from infervisor.supervisor.toolkit.inputs import random_inputs"),
    ],
)
def test_an_up_arrow_is_named(tmp_path: Path, module: str, line: str) -> None:
    """A toolkit module importing a command or the core, or a core module the CLI or the toolkit, fails the check."""
    folder = tmp_path / "supervisor"
    shutil.copytree(Path(cli.__file__).resolve().parent, folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_line_after_future_import(folder / module, line)
    offences = up_arrows(folder, cli.__name__.removesuffix(".cli"))
    assert len(offences) == 1 and offences[0].startswith(f"{module} -> "), offences


def _type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _modules_under(folder: Path, package: str) -> dict[str, Path]:
    """Every module of the package in `folder` by its import name (a package by its `__init__.py`)."""
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        modules[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return modules


def _import_graph(folder: Path, package: str) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """Each module's imports within the package (lazy and type-only ones too, and the packages an import runs), and
    the (importer, imported) pairs written under `if TYPE_CHECKING:`."""
    modules = _modules_under(folder, package)

    def resolve(name: str) -> set[str]:
        # `from a.b import c` imports module a.b.c when there is one, else a name of a.b; either runs a.b's __init__.
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()

    graph: dict[str, set[str]] = {}
    type_only: list[tuple[str, str]] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = {id(n) for block in ast.walk(tree) if _type_checking_block(block) for n in ast.walk(block)}
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                targets = resolve(name) - {module}
                graph[module] |= targets
                if id(node) in hidden and name.startswith(f"{package}."):
                    type_only += [(module, target) for target in sorted(targets) if target != package]
    return graph, type_only


def hidden_cycles(folder: Path, package: str) -> list[str]:
    """Each `if TYPE_CHECKING:` import of a module that, through any chain of imports, imports its importer back."""
    graph, type_only = _import_graph(folder, package)
    offences = []
    for importer, imported in type_only:
        came_from: dict[str, str] = {imported: ""}
        frontier = [imported]
        while frontier and importer not in came_from:
            module = frontier.pop()
            for target in sorted(graph[module] - came_from.keys()):
                came_from[target] = module
                frontier.append(target)
        if importer in came_from:
            chain = [importer]
            while chain[-1] != imported:
                chain.append(came_from[chain[-1]])
            offences.append(f"{importer} -> (TYPE_CHECKING) " + " -> ".join(reversed(chain)))
    return offences


def test_no_type_checking_import_hides_an_import_cycle() -> None:
    """No supervisor module imports for types only a module that imports it back, directly or through others."""
    folder = Path(cli.__file__).resolve().parent
    assert hidden_cycles(folder, cli.__name__.removesuffix(".cli")) == []


def test_a_type_checking_import_that_closes_a_cycle_is_named(tmp_path: Path) -> None:
    """A type-only import added to a copy of the supervisor, of a module that imports the importer back, is reported
    with the chain that closes the cycle."""
    folder = tmp_path / "supervisor"
    shutil.copytree(Path(cli.__file__).resolve().parent, folder, ignore=shutil.ignore_patterns("__pycache__"))
    package = cli.__name__.removesuffix(".cli")
    add_line_after_future_import(
        folder / "routing" / "pending.py",
        f"from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from {package}.routing.broker import Broker\n",
    )
    pending, broker = f"{package}.routing.pending", f"{package}.routing.broker"
    named = [o for o in hidden_cycles(folder, package) if o.startswith(f"{pending} -> (TYPE_CHECKING)")]
    assert named == [f"{pending} -> (TYPE_CHECKING) {broker} -> {pending}"]


#: Helpers a bench script or a command imports from their own leaf module, never through the daemon's core.
HELPER_HOMES = {
    "percentile": "infervisor.supervisor.observe.stats",
    "random_inputs": "infervisor.supervisor.toolkit.inputs",
}
#: The daemon's core: a bench script starts a daemon (bench/daemon.py) and talks to it through sockets (the control
#: client is infervisor/protocol/control_client.py), or runs a bare broker of its own (bench/bare_broker.py); none
#: builds the supervisor's broker, pool or loop in process.
BENCH_NEVER_IMPORTS = (
    "infervisor.supervisor.routing",
    "infervisor.supervisor.lifecycle",
    "infervisor.supervisor.monitors",
    "infervisor.supervisor.core",
)


def helper_offences(root: Path) -> list[str]:
    """Imports of a shared helper from anywhere but its home (bench scripts and supervisor/), and bench scripts
    importing the daemon's core."""
    offences = []
    paths = [*sorted((root / "bench").glob("*.py")), *sorted((root / "infervisor" / "supervisor").rglob("*.py"))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                offences += [
                    f"{path.relative_to(root)}: {alias.name} from {node.module}, not {HELPER_HOMES[alias.name]}"
                    for alias in node.names
                    if alias.name in HELPER_HOMES and node.module != HELPER_HOMES[alias.name]
                ]
        if path.parent.name == "bench":
            offences += [
                f"{path.relative_to(root)} -> {name}"
                for name in _imported_modules(path, "infervisor")
                if any(name == core or name.startswith(f"{core}.") for core in BENCH_NEVER_IMPORTS)
            ]
    return offences


def test_bench_scripts_and_commands_take_helpers_from_leaves_not_the_core() -> None:
    """percentile comes from observe/stats and random_inputs from toolkit/inputs, and no bench script imports the
    broker, the pool, the monitors or anything of core/ (the loop, the control server)."""
    assert helper_offences(ROOT) == []


@pytest.mark.parametrize(
    ("script", "line", "offence"),
    [
        (
            "bench/rolling.py",
            "from infervisor.supervisor.observe.status import percentile",
            "percentile from infervisor.supervisor.observe.status, not infervisor.supervisor.observe.stats",
        ),
        (
            "bench/chaos.py",
            "from infervisor.supervisor.routing.broker import Broker",
            "bench/chaos.py -> infervisor.supervisor.routing.broker.Broker",
        ),
        (
            "bench/daemon.py",
            "from infervisor.supervisor.core.control import ControlServer",
            "bench/daemon.py -> infervisor.supervisor.core.control.ControlServer",
        ),
    ],
)
def test_a_helper_taken_through_the_core_is_named(tmp_path: Path, script: str, line: str, offence: str) -> None:
    """A bench script that imports a helper from elsewhere than its home, the broker or the core, fails the check."""
    for folder in ("bench", "infervisor/supervisor"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_line_after_future_import(tmp_path / script, line)
    offences = helper_offences(tmp_path)
    assert len(offences) == 1 and offence in offences[0], offences


#: supervisor/'s folders from the top down (docs/architecture.md): each imports only folders after it in this list, and
#: folders in one tuple import neither each other.
FOLDER_LAYERS = (
    ("__main__",),
    ("cli",),
    ("commands",),
    ("toolkit", "core"),
    ("observe",),
    ("lifecycle",),
    ("monitors",),
    ("routing",),
    ("workers",),
    ("settings",),
    ("host", "instruments"),
)


def layer_breaches(folder: Path, package: str, layers: tuple[tuple[str, ...], ...] = FOLDER_LAYERS) -> list[str]:
    """Imports from one folder (or top-level module) of `package` into one at its own level or above it (other than
    itself), by `layers`."""
    level = {name: rank for rank, names in enumerate(layers) for name in names}
    offences = []
    for path in sorted(folder.rglob("*.py")):
        part = path.relative_to(folder).parts[0].removesuffix(".py")
        if part not in level:
            continue
        for name in sorted(_imported_modules(path, package)):
            target = name.removeprefix(f"{package}.").split(".")[0]
            if target != part and target in level and level[target] <= level[part]:
                offences.append(f"{path.relative_to(folder)} -> {name}")
    return offences


def test_every_supervisor_folder_imports_only_the_folders_below_it() -> None:
    """The folders stand in layers: no import runs back up or sideways, so no two folders import each other."""
    folder = Path(cli.__file__).resolve().parent
    assert {path.name for path in folder.iterdir() if path.is_dir() and path.name != "__pycache__"} <= {
        name for names in FOLDER_LAYERS for name in names
    }, "a new folder needs its place in FOLDER_LAYERS (and in docs/architecture.md)"
    assert layer_breaches(folder, cli.__name__.removesuffix(".cli")) == []


def test_an_import_back_up_the_layers_is_named(tmp_path: Path) -> None:
    """A slot that imports the broker (routing sits above workers) fails the check, named."""
    folder = tmp_path / "supervisor"
    shutil.copytree(Path(cli.__file__).resolve().parent, folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_line_after_future_import(folder / "workers" / "slot.py", "from infervisor.supervisor.routing import broker")
    assert layer_breaches(folder, "infervisor.supervisor") == [
        "workers/slot.py -> infervisor.supervisor.routing.broker"
    ]


def pipeline_readers(folder: Path) -> list[str]:
    """Places outside routing/ that name the broker's `pipelines` (the rest reads them through `Broker.load_of`)."""
    places = []
    for path in sorted(folder.rglob("*.py")):
        if path.relative_to(folder).parts[0] == "routing":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "pipelines":
                places.append(f"{path.relative_to(folder)}:{node.lineno}")
    return places


def test_only_the_request_path_touches_the_pipelines() -> None:
    """The pool, the stop and the snapshot read a worker's load through the broker's read-only view only."""
    assert pipeline_readers(Path(cli.__file__).resolve().parent) == []


def test_a_pool_reaching_into_the_pipelines_is_named(tmp_path: Path) -> None:
    """A lifecycle module that reads `broker.pipelines` is named with its line."""
    (tmp_path / "lifecycle").mkdir()
    reader = "def busy(broker, slot):\n    return broker.pipelines.of(slot).held\n"
    (tmp_path / "lifecycle" / "pool.py").write_text(reader)
    (tmp_path / "routing").mkdir()
    (tmp_path / "routing" / "broker.py").write_text("def held(self):\n    return self.pipelines.held_count\n")
    assert pipeline_readers(tmp_path) == ["lifecycle/pool.py:2"]


#: What starts, signals or ends a process: a monitor only reports, and the pool or core/responses.py acts.
PROCESS_KEEPERS = (
    "infervisor.supervisor.workers.launcher",
    "infervisor.supervisor.workers.child_home",
    "infervisor.supervisor.workers.process_tree",
    "infervisor.supervisor.workers.gateway_process",
    "infervisor.supervisor.workers.audit_process.AuditProcess",
    "subprocess",
    "signal",
    "os.kill",
    "os.killpg",
)


def process_keepers(folder: Path) -> list[str]:
    """Places in monitors/ that import what starts, signals or ends a process, or call os.kill or os.killpg."""
    places = []
    for path in sorted((folder / "monitors").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
                names = [f"os.{node.attr}"]
            else:
                continue
            if any(name == keeper or name.startswith(f"{keeper}.") for name in names for keeper in PROCESS_KEEPERS):
                places.append(f"{path.relative_to(folder)}:{node.lineno}")
    return sorted(places)


def test_no_monitor_starts_signals_or_ends_a_process() -> None:
    """Monitors never act: nothing in monitors/ reaches a launcher, the child home, a process class or a kill."""
    assert process_keepers(Path(cli.__file__).resolve().parent) == []


def test_a_monitor_keeping_a_process_is_named(tmp_path: Path) -> None:
    """A monitor that imports the audit process class or calls os.kill is named with each line."""
    (tmp_path / "monitors").mkdir()
    keeper = (
        "from infervisor.supervisor.workers.audit_process import AuditProcess, AuditState\n"
        "import os\n\n\ndef end(pid):\n    os.kill(pid, 9)\n"
    )
    (tmp_path / "monitors" / "leak.py").write_text(keeper)
    assert process_keepers(tmp_path) == ["monitors/leak.py:1", "monitors/leak.py:6"]


#: worker/'s modules and folders from the top down (docs/architecture.md), in the supervisor's style: each imports only
#: what stands after it, and nothing at its own level, so the start sequence and the serving loop never import each
#: other (serve.py joins them) and profiles/ never reaches the process that runs it.
WORKER_LAYERS = (
    ("__main__", "audit", "bench", "template"),  # the processes: worker, audit, bench, the warm template
    ("serve", "audit_loop", "process_entry"),  # a serving worker, start to exit; the audit's loop; both set-ups
    ("start", "loop"),  # the start sequence (load, select, re-exec, READY, LOAD_ERROR); the serving loop
    ("profiles", "state_check", "open_dims"),  # building, gating and picking profiles; checks the start runs
    ("loader", "request_path", "batching", "progress", "reexec", "memory"),  # what the start and the loop call
    ("runner", "shared_inputs", "models"),  # the model as the worker runs it; inputs in shared memory; model sources
    ("synthetic", "trusted_import", "process_tree", "pinning", "stop_sentinel", "logs"),  # leaves
)
WORKER = ROOT / "infervisor" / "worker"


def test_every_worker_module_imports_only_the_layers_below_it() -> None:
    """worker/ stands in layers too: no import runs back up or sideways (the start and the loop are apart)."""
    parts = {
        path.name.removesuffix(".py") for path in WORKER.iterdir() if path.name not in ("__pycache__", "__init__.py")
    }
    placed = {name for names in WORKER_LAYERS for name in names}
    assert parts <= placed, f"{sorted(parts - placed)} need a place in WORKER_LAYERS (and in docs/architecture.md)"
    assert layer_breaches(WORKER, "infervisor.worker", WORKER_LAYERS) == []


@pytest.mark.parametrize(
    ("module", "line", "offence"),
    [
        ("start.py", "from infervisor.worker.loop import WorkerLoop", "start.py -> infervisor.worker.loop.WorkerLoop"),
        (
            "profiles/select.py",
            "def _loop() -> object:\n    from infervisor.worker import serve\n\n    return serve",
            "profiles/select.py -> infervisor.worker.serve",
        ),
    ],
)
def test_a_worker_import_across_or_up_the_layers_is_named(tmp_path: Path, module: str, line: str, offence: str) -> None:
    """The start sequence importing the loop, or a profile module (lazily) the serving entry, fails the check, named."""
    folder = tmp_path / "worker"
    shutil.copytree(WORKER, folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_line_after_future_import(folder / module, line)
    assert layer_breaches(folder, "infervisor.worker", WORKER_LAYERS) == [offence]


def test_no_worker_type_checking_import_hides_an_import_cycle() -> None:
    """No worker module imports for types only a module that imports it back, directly or through others."""
    assert hidden_cycles(WORKER, "infervisor.worker") == []


def import_cycles(folder: Path, package: str) -> list[str]:
    """Each module that, through any chain of imports (lazy ones inside functions too), imports itself back.

    A module's own parent packages are left out of what it imports: they run before it, never because of it.
    """
    full, _ = _import_graph(folder, package)
    graph = {module: {t for t in targets if not module.startswith(f"{t}.")} for module, targets in full.items()}
    offences = []
    for start in sorted(graph):
        came_from: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in came_from:
            module = frontier.pop()
            for target in sorted(graph[module] - came_from.keys()):
                came_from[target] = module
                frontier.append(target)
        if start in came_from:
            chain = [start]
            while chain[-1] != start or len(chain) == 1:
                chain.append(came_from[chain[-1]])
            offences.append(" -> ".join(reversed(chain)))
    return offences


def test_no_worker_module_imports_itself_back() -> None:
    """No worker or supervisor module reaches itself through its imports, a function-level import included."""
    assert import_cycles(WORKER, "infervisor.worker") == []
    assert import_cycles(Path(cli.__file__).resolve().parent, cli.__name__.removesuffix(".cli")) == []


def test_a_function_level_import_circle_is_named(tmp_path: Path) -> None:
    """covered_export.py importing advice.py inside a function closes a circle, named from both ends."""
    folder = tmp_path / "worker"
    shutil.copytree(WORKER, folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_line_after_future_import(
        folder / "profiles" / "covered_export.py",
        "def _advice() -> object:\n    from infervisor.worker.profiles import advice\n\n    return advice",
    )
    advice, covered = "infervisor.worker.profiles.advice", "infervisor.worker.profiles.covered_export"
    assert import_cycles(folder, "infervisor.worker") == [
        f"{advice} -> {covered} -> {advice}",
        f"{covered} -> {advice} -> {covered}",
    ]


#: What runs on every request for a worker's life, and the profile building it must never reach: the package it
#: calls was built at the start (or by the background builder), so serving needs no exporter, compiler or quantizer.
SERVE_TIME = ("infervisor.worker.loop", "infervisor.worker.profiles.dispatch", "infervisor.worker.profiles.coverage")
BUILD_SIDE = ("build", "builders", "covered_export", "export", "advice", "openvino", "select", "golden", "calibration")


def build_reached_at_serve_time(folder: Path, package: str) -> list[str]:
    """Each serve-time module with the build-side module it reaches through any chain of imports (a serve-time
    module that is gone is named too: a rename must not leave the check looking at nothing)."""
    graph, _ = _import_graph(folder, package)
    missing = [f"{name} is not a module" for name in SERVE_TIME if name not in graph]
    build = {f"{package}.profiles.{name}" for name in BUILD_SIDE}
    offences = []
    for start in SERVE_TIME:
        seen, frontier = {start}, [start]
        while frontier:
            for target in sorted(graph.get(frontier.pop(), set()) - seen):
                seen.add(target)
                frontier.append(target)
        offences += [f"{start} -> {name}" for name in sorted(seen & build)]
    return missing + offences


def test_serving_never_reaches_profile_building() -> None:
    """The serving loop and the serve-time dispatch import nothing of building, gating or picking a profile."""
    assert build_reached_at_serve_time(WORKER, "infervisor.worker") == []


def test_serve_time_dispatch_reaching_the_exporter_is_named(tmp_path: Path) -> None:
    """dispatch.py importing export.py (for its error, say) is named as serve time reaching the build side."""
    folder = tmp_path / "worker"
    shutil.copytree(WORKER, folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_line_after_future_import(
        folder / "profiles" / "dispatch.py", "from infervisor.worker.profiles.export import ExportError"
    )
    offences = build_reached_at_serve_time(folder, "infervisor.worker")
    assert "infervisor.worker.profiles.dispatch -> infervisor.worker.profiles.export" in offences, offences
