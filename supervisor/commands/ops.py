"""`infervisor restart` and `infervisor reload`: operator commands over the control socket."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from supervisor.control import ControlError, control_request
from supervisor.runtime_dir import resolve_runtime_dir

#: Exit statuses: the daemon took the command, refused it, or could not be asked at all.
EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 2


def _config_path(runtime_dir: Path) -> str:
    """The file the daemon re-reads, for the sentence; "its config.json" when status does not say."""
    try:
        path = control_request(runtime_dir, {"cmd": "status"})["config"]["path"]
    except (ControlError, KeyError, TypeError):
        return "its config.json"
    return str(path)


def describe(command: str, model: str | None, answer: dict[str, Any], config_path: str = "") -> str:
    """One sentence on what the daemon did with the command."""
    if not answer.get("ok"):
        return f"infervisor {command}: the daemon refused: {answer.get('error', 'no reason given')}"
    if command == "reload":
        return (
            f"reload queued: the daemon re-reads {config_path or 'its config.json'} now; a bad file changes "
            "nothing, and `infervisor status` shows what was applied or why it was refused"
        )
    queued = int(answer.get("queued", 0))
    which = f"model {model}" if model else "every model"
    if queued == 0:
        return f"nothing to restart: {which} has no worker"
    workers = "worker" if queued == 1 else "workers"
    return (
        f"restart queued: {queued} {workers} of {which}, replaced one at a time, each retired only once its "
        "successor serves; `infervisor status` shows the progress"
    )


def run_control(args: argparse.Namespace) -> int:
    """Send restart/reload to the daemon and say what it did: 0 queued, 1 refused, 2 no daemon to ask."""
    command: dict[str, object] = {"cmd": args.command}
    model = getattr(args, "model", None)
    if args.command == "restart" and model:
        command["model"] = model
    runtime_dir = resolve_runtime_dir(args.runtime_dir, None)
    try:
        answer = control_request(runtime_dir, command)
    except ControlError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        else:
            print(f"infervisor {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    ok = bool(answer.get("ok"))
    if args.json:
        print(json.dumps(answer))
    elif ok:
        print(describe(args.command, model, answer, _config_path(runtime_dir) if args.command == "reload" else ""))
    else:
        print(describe(args.command, model, answer), file=sys.stderr)
    return EXIT_OK if ok else EXIT_REFUSED
