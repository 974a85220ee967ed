"""`infervisor` command line: serve, status, metrics, infer, restart, reload, demo, bench and the toolkit commands.

The commands are one table (infervisor/supervisor/commands/registry.py); each command's module is imported only when it
runs, so `serve` starts without the toolkit's imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence

from infervisor.protocol.constants import PROTOCOL_VERSION
from infervisor.supervisor.commands import registry

#: The import names of the `server` extra (pyproject.toml): a client-only install (`pip install infervisor`)
#: has none of them, and every subcommand needs some (tests/test_client_install.py keeps the two in step).
SERVER_MODULES = frozenset(
    {"torch", "psutil", "structlog", "watchdog", "prometheus_client", "cryptography", "setproctitle"}
)
SERVER_HINT = "this command needs the daemon's dependencies: pip install 'infervisor[server]'"


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default when it has a meaningful one (not None, False or already in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (
            text
            and "%(default)" not in text
            and action.option_strings
            and action.default not in (None, False, True, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


def missing_server_modules() -> list[str]:
    """The modules of the `server` extra this interpreter cannot import (found without importing them)."""
    return sorted(name for name in SERVER_MODULES if importlib.util.find_spec(name) is None)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("infervisor")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        number = "unknown (not installed)"
    return f"infervisor {number} (wire protocol {PROTOCOL_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand of the command table (infervisor/supervisor/commands/registry.py) with its options."""
    parser = argparse.ArgumentParser(
        prog="infervisor", description="Serve PyTorch models on CPU workers.", formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in registry.CLI_COMMANDS.values():
        text = command.help
        command.add_options(sub.add_parser(command.name, help=text, description=text, formatter_class=_HelpFormatter))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script: a closed pipe or Ctrl-C ends it with a status, not a traceback."""
    who = "infervisor"
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            # --help, --version and usage errors end here, once argparse has printed: flush inside the try too.
            sys.stdout.flush()
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        who = f"infervisor {args.command}"
        missing = missing_server_modules()
        if missing:
            # A client-only install: one line, not a traceback from the command's imports (or, for
            # optimize and bench, from the measuring processes they start).
            print(f"{who}: {SERVER_HINT} (missing: {', '.join(missing)})", file=sys.stderr)
            return 2
        code = _run(args)
        # Flushed here, inside the try: a reader that went away (`| head`) shows up now, not in the exit flush.
        sys.stdout.flush()
    except BrokenPipeError:
        # The Python docs' recipe (signal module, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's own flush at exit does not raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{who}: interrupted", file=sys.stderr)
        return 130
    return code


def _run(args: argparse.Namespace) -> int:
    """The command's handler, imported only now, run on the parsed arguments."""
    handler: Callable[[argparse.Namespace], int] = pkgutil.resolve_name(registry.CLI_COMMANDS[args.command].handler)
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
