"""`infervisor serve`: validate the config, prepare the runtime dir, run the arbiter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import structlog

from infervisor.supervisor.host.instance_lock import InstanceLock, InstanceLockError
from infervisor.supervisor.host.logs import configure_logging
from infervisor.supervisor.host.planner import PlanError
from infervisor.supervisor.host.runtime_dir import (
    RuntimeDirError,
    prepare_runtime_dir,
    resolve_runtime_dir,
    restrict_runtime_dir,
)
from infervisor.supervisor.host.socket_group import SocketGroupError
from infervisor.supervisor.host.topology import TopologyError
from infervisor.supervisor.settings.config import ConfigError, load_config
from infervisor.supervisor.settings.config_path import ConfigPathError, resolve_config_path

#: Exit status for a configuration the daemon cannot start with (systemd: do not restart-loop on it).
EXIT_CONFIG = 78


def say_refusal(config: object, problems: list[str]) -> None:
    """Why the daemon does not start, as plain lines on stderr before the JSON log line: what a person reads."""
    where = f"{config}: " if config else ""
    for problem in problems:
        print(f"infervisor serve: {where}{problem}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT; non-zero when it cannot start or every worker failed."""
    configure_logging()
    log = structlog.get_logger("supervisor")
    try:
        choice = resolve_config_path(args.config)
    except ConfigPathError as exc:
        say_refusal(None, [str(exc)])
        log.error("config_invalid", config=None, problems=[str(exc)])
        return EXIT_CONFIG
    config_path = choice.path
    log.info("config_chosen", config=str(config_path), source=choice.source)
    try:
        source_dir = Path(args.source_dir) if args.source_dir else None
        config = load_config(config_path, source_dir)
        configure_logging(config.log_level)
        where = resolve_runtime_dir(args.runtime_dir, config.runtime_dir)
        runtime_dir = prepare_runtime_dir(where, config.socket_group)
        # Before any socket is bound or worker spawned: a second daemon here would take both sockets over.
        lock = InstanceLock(runtime_dir)
        restrict_runtime_dir(runtime_dir, config.socket_group)
        from infervisor.supervisor.core.arbiter import Arbiter

        arbiter = Arbiter(config, config_path, runtime_dir, Path(args.sysfs_root), source_dir=source_dir)
    except ConfigError as exc:
        say_refusal(config_path, list(exc.problems))
        log.error("config_invalid", config=str(config_path), problems=exc.problems)
        return EXIT_CONFIG
    except SocketGroupError as exc:  # the group exists, but the daemon's user may not give it files
        say_refusal(config_path, [f"socket_group: {exc}"])
        log.error("config_invalid", config=str(config_path), problems=[f"socket_group: {exc}"])
        return EXIT_CONFIG
    except InstanceLockError as exc:
        say_refusal(None, [str(exc)])
        log.error("cannot_start", error=str(exc), holder_pid=exc.holder_pid)
        return EXIT_CONFIG
    except (PlanError, TopologyError, RuntimeDirError) as exc:
        say_refusal(None, [str(exc)])
        log.error("cannot_start", error=str(exc))
        return EXIT_CONFIG
    with lock:  # released only once the daemon has removed its sockets and reaped its workers
        return arbiter.run()
