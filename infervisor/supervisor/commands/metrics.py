"""`infervisor metrics`: the daemon's Prometheus text over the control socket, with or without metrics_listen."""

from __future__ import annotations

import argparse
import sys

from infervisor.protocol.control_client import ControlError, control_request
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir

#: Exit statuses, as the other control commands have them.
EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 2


def run_metrics(args: argparse.Namespace) -> int:
    """Print the exposition text: 0 printed, 1 the daemon refused, 2 no daemon to ask."""
    try:
        answer = control_request(resolve_runtime_dir(args.runtime_dir, None), {"cmd": "metrics"})
    except ControlError as exc:
        print(f"infervisor metrics: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    text = answer.get("text")
    if not answer.get("ok") or not isinstance(text, str):
        why = answer.get("error", "no text in its answer")
        print(f"infervisor metrics: the daemon refused: {why}", file=sys.stderr)
        return EXIT_REFUSED
    sys.stdout.write(text)
    return EXIT_OK
