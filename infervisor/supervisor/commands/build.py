"""`infervisor build`: fill the compiled-package cache for a config, ahead of deployment (images, fleets).

For each model of the config one worker process is started exactly as the daemon starts slot 0
(same pinning and threads, same launch spec, same cache directory and keys), in build mode: it runs
the profile selection the daemon's worker would (a fastest pick is timed and remembered), then
builds and checks every other packaged profile of the chain, reports each step over its link,
and exits without serving. No compile limit applies here: this is where a build too long for the
daemon's `compile_timeout_s` is done once. A worker that dies natively on a profile is started
again, told how its predecessor ended, so it records that crash (as a daemon worker would) and
goes on with the rest of the chain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from infervisor.common.profiles import PROFILES
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import COMPILE_PHASES, OUTCOME_PHASES, StartPhase
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.worker_link import LinkClosed
from infervisor.supervisor.commands.bundle import run_export, run_import, run_keygen
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.host.planner import Assignment, PlanError, WorkerDemand, plan_cores
from infervisor.supervisor.host.topology import TopologyError, read_topology
from infervisor.supervisor.settings.config import Config, ConfigError, load_config
from infervisor.supervisor.settings.config_path import ConfigPathError, resolve_config_path
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.launcher import ExitRecord, launch_worker
from infervisor.supervisor.workers.slot import describe_exit

#: A phase longer than this gets a "still ..." line, so a log (a CI job, an image build) never goes quiet.
_STILL_EVERY_S = 60.0
#: Exit statuses: every packaged profile built (or was not applicable), one failed, the command could not run.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: The outcome of a profile whose build killed its worker (a signal), beside the StartPhase outcomes.
CRASHED = "crashed"
#: The outcomes that make the command fail: the cache could not be filled with that profile.
_FAILING = frozenset({StartPhase.FAILED.value, CRASHED})


@dataclass
class ProfileOutcome:
    """What building one profile of a model came to."""

    model: str
    profile: str
    outcome: str
    detail: str
    seconds: float


@dataclass
class ModelBuild:
    """One model's build: its outcomes, and why its worker ended badly (None: it exited 0)."""

    model: str
    outcomes: list[ProfileOutcome] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    #: Where its workers' own log went.
    log: str = ""

    def failures(self) -> list[str]:
        """`model profile: why` for each profile whose build failed, and the worker's own end if it failed."""
        failed = [f"{self.model} {o.profile}: {o.detail}" for o in self.outcomes if o.outcome in _FAILING]
        return failed + ([f"{self.model}: {self.error} (its log: {self.log})"] if self.error else [])


def plan_for(config: Config, model: ModelConfig) -> Assignment:
    """Slot 0 of the model as the daemon would pin it (shared cores allowed: only this one worker runs now)."""
    demand = WorkerDemand(model.name, 1, model.cores_per_worker, model.use_smt, model.threads)
    (assignment,) = plan_cores(read_topology(), os.sched_getaffinity(0), [demand], oversubscribe=True)
    return assignment


class _Watch:
    """Prints one model worker's PROGRESS as it comes, and keeps each profile's outcome."""

    def __init__(self, build: ModelBuild, say: Callable[[str], None], packages: list[str]) -> None:
        self.build = build
        #: The chain's packaged profiles, in order: progress counts these, not the profile's place in the chain.
        self.packages = packages
        self.say = say
        self.started = time.monotonic()
        self.phase = StartPhase.LOADING
        self.about = ""
        self.profile = ""
        self.phase_at = self.started
        self.still_at = self.started + _STILL_EVERY_S

    def line(self, text: str) -> None:
        self.say(f"{self.build.model} [{time.monotonic() - self.started:6.1f} s] {text}")

    def where(self, profile: str) -> str:
        """`int8_static (package 1 of 2)`; a profile the cache holds nothing of, by its name."""
        if profile in self.packages:
            return f"{profile} (package {self.packages.index(profile) + 1} of {len(self.packages)})"
        return profile

    def on(self, progress: wm.Progress) -> None:
        try:
            phase = StartPhase(progress.phase)
        except ValueError:
            return
        now = time.monotonic()
        where = self.where(progress.profile) if progress.profile else ""
        if phase in OUTCOME_PHASES:
            took = now - self.phase_at if self.about == where else 0.0
            self.build.outcomes.append(
                ProfileOutcome(self.build.model, progress.profile, phase.value, progress.detail, round(took, 1))
            )
            detail = " ".join(progress.detail.split())  # an exception's lines, on one line of the log
            self.line(f"{where}: {phase.value}")
            # A check's report runs to hundreds of characters: wrapped under its line, not one wall of text.
            for chunk in textwrap.wrap(detail, 100, break_on_hyphens=False):
                self.say(f"    {chunk}")
            return
        if phase is not StartPhase.WAITING and self.about != where:
            self.phase_at = now  # a profile's time runs from its first phase to its outcome
        self.phase, self.about, self.profile, self.still_at = phase, where, progress.profile, now + _STILL_EVERY_S
        self.line(f"{where + ': ' if where else ''}{phase.value}")

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self.still_at:
            self.still_at = now + _STILL_EVERY_S
            doing = "compiling" if self.phase in COMPILE_PHASES else self.phase.value
            on_it = f", {now - self.phase_at:.0f} s on it so far" if self.about else ""
            self.line(f"still {doing}{' ' + self.about if self.about else ''}{on_it}")


def _run_worker(
    config: Config, model: ModelConfig, assignment: Assignment, exits: list[ExitRecord], watch: _Watch, log: IO[bytes]
) -> tuple[int, int]:
    """One build-mode worker to its end, its progress printed and its own log written to `log`; (exit code, pid)."""
    launched = launch_worker(model, assignment, config, exits, build_only=True, output=log)
    link = launched.link
    process = launched.process
    try:
        while link is not None:
            if link.wait_readable(1.0):
                try:
                    messages = link.receive()
                except (LinkClosed, ProtocolError):
                    break
                for frames in messages:
                    try:
                        message = wm.decode(frames[0])
                    except ProtocolError:
                        continue
                    if isinstance(message, wm.Progress):
                        watch.on(message)
            watch.tick()
        return process.wait(), process.pid
    except BaseException:  # Ctrl-C: no build worker may outlive the command
        process.kill()
        process.wait()
        raise
    finally:
        if link is not None:
            link.close()


def build_model(config: Config, model: ModelConfig, say: Callable[[str], None]) -> ModelBuild:
    """Build every packaged profile of one model's chain in worker processes pinned like its slot 0."""
    build = ModelBuild(model.name)
    started = time.monotonic()
    try:
        assignment = plan_for(config, model)
    except (PlanError, TopologyError) as exc:
        build.error = f"cannot pin a worker as the daemon would: {exc}"
        return build
    packaged = [p for p in model.profiles if PROFILES[p].packaged]
    others = model.workers - 1
    # The daemon's workers differ only in their cores: one, pinned as its first would be, builds what all load.
    load = {0: "", 1: "; the daemon's other worker loads what it builds"}.get(
        others, f"; the daemon's other {others} workers load what it builds"
    )
    say(
        f"{model.name}: chain {', '.join(model.profiles)} "
        f"({len(packaged)} to package: {', '.join(packaged) or 'none'}), "
        f"pick {model.pick}; built by one worker pinned as the daemon's first (cpus {list(assignment.cpus)}, "
        f"{assignment.threads} torch thread{'s' if assignment.threads != 1 else ''}){load}"
    )
    watch = _Watch(build, say, packaged)
    exits: list[ExitRecord] = []
    # The workers' JSON logs would drown the progress lines: kept in a file, named when something fails.
    with tempfile.NamedTemporaryFile(prefix=f"infervisor-build-{model.name}-", suffix=".log", delete=False) as log:
        build.log = log.name
        # Each native crash costs one profile of the chain: the next worker records it and skips that one.
        for _ in range(len(model.profiles) + 1):
            code, pid = _run_worker(config, model, assignment, exits, watch, log)
            if code == 0:
                break
            how = describe_exit(code)
            if code > 0 or not watch.profile:
                build.error = f"the worker ended with {how} while {watch.phase.value} {watch.about}".rstrip()
                break
            why = f"the worker was {how} while {watch.phase.value}"
            build.outcomes.append(ProfileOutcome(model.name, watch.profile, CRASHED, why, 0.0))
            watch.line(f"{watch.about}: {why}; starting another, which skips it")
            exits.append({"pid": pid, "how": how, "signal": -code, "killed_by_supervisor": False})
        else:
            build.error = "every profile of the chain crashed its worker"
    build.seconds = round(time.monotonic() - started, 1)
    return build


def _summary(build: ModelBuild) -> str:
    outcomes = ", ".join(f"{o.profile} {o.outcome}" for o in build.outcomes) or "nothing built"
    ending = f"; {build.error}" if build.error else ""
    return f"{build.model}: done in {build.seconds:.1f} s: {outcomes}{ending}"


def _say(line: str) -> None:
    print(line, flush=True)  # a pipe (tee, a CI log) sees each step as it happens


def refusals_of(builds: list[ModelBuild]) -> list[dict[str, str]]:
    """Each profile that did not pass, as a bundle carries it: model, profile, outcome and why."""
    return [
        {"model": o.model, "profile": o.profile, "outcome": o.outcome, "reason": " ".join(o.detail.split())[:2000]}
        for b in builds
        for o in b.outcomes
        if o.outcome != StartPhase.PASSED.value
    ]


def run_build(args: argparse.Namespace, say: Callable[[str], None] = _say) -> int:
    """Build the config's packaged profiles into its cache directory: 0 all built, 1 one failed, 2 bad input.

    With --export the bundle is written whatever did not build (the refusals travel in it): 0 once it is written
    and every model's worker ended well, 1 when one did not, 2 when no bundle was written.
    """
    if getattr(args, "keygen", None):
        return run_keygen(Path(args.keygen), say)
    try:
        choice = resolve_config_path(args.config)
        config = load_config(choice.path)
    except ConfigPathError as exc:
        print(f"infervisor build: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"infervisor build: {choice.path} is not a valid config:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "import_bundle", None):
        cache = resolve_cache_dir(config.cache_dir)
        allow = bool(getattr(args, "allow_unsigned", False))
        return run_import(Path(args.import_bundle), cache, say, config.bundle_keys, allow)
    names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models else list(config.models)
    unknown = sorted(set(names) - set(config.models))
    if unknown:
        print(f"infervisor build: no model {', '.join(unknown)} in {choice.path}", file=sys.stderr)
        return EXIT_USAGE
    cache = resolve_cache_dir(config.cache_dir)
    # A caller that already named the config (the demo) gets the cache only: one `config:` line on the screen.
    say(f"cache: {cache}" if getattr(args, "config_named", False) else f"config: {choice.describe()}; cache: {cache}")
    builds = [build_model(config, config.models[name], say) for name in names]
    for build in builds:
        say(_summary(build))
    if args.json:
        rows: list[dict[str, Any]] = [vars(o) for b in builds for o in b.outcomes]
        errors = [{"model": b.model, "error": b.error, "seconds": b.seconds} for b in builds]
        Path(args.json).write_text(json.dumps({"profiles": rows, "models": errors}, indent=1))
    failures = [line for build in builds for line in build.failures()]
    exporting = getattr(args, "export", None)
    if failures:
        print(f"infervisor build: not every package was built{' (exported as refusals)' if exporting else ''}:",
              file=sys.stderr)  # fmt: skip
        for line in failures:
            print(f"  {line}", file=sys.stderr)
    if exporting:
        exported = run_export(cache, Path(exporting), say, refusals_of(builds), getattr(args, "sign", None))
        return exported if exported != 0 or not any(b.error for b in builds) else EXIT_FAILED
    return EXIT_FAILED if failures else EXIT_OK
