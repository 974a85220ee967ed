"""`infervisor restart` and `infervisor reload`: operator commands over the control socket."""

from __future__ import annotations

import argparse
import json

from supervisor.control import ControlError, control_request
from supervisor.runtime_dir import resolve_runtime_dir


def run_control(args: argparse.Namespace) -> int:
    """Send restart/reload to the daemon and print its answer."""
    command: dict[str, object] = {"cmd": args.command}
    if args.command == "restart" and args.model:
        command["model"] = args.model
    try:
        answer = control_request(resolve_runtime_dir(args.runtime_dir, None), command)
    except ControlError as exc:
        print(f"infervisor {args.command}: {exc}")
        return 2
    print(json.dumps(answer))
    return 0 if answer.get("ok") else 1
