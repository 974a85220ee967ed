"""`infervisor fallback`: move a model one step down its validated chain, live and rolling, or back (--reset)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from infervisor.protocol.control_client import ControlError, control_request
from infervisor.supervisor.commands.ops import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, wait_for_rollouts
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir


def describe(answer: dict[str, Any], reset: bool) -> str:
    """One sentence on what the daemon did."""
    if not answer.get("ok"):
        return f"infervisor fallback: the daemon refused: {answer.get('error', 'no reason given')}"
    cleared = answer.get("refusals_cleared")
    if "profiles" not in answer:  # no fallback was in force: only the recorded refusals went
        return f"{answer['model']}: {cleared} recorded refusals cleared; its workers are rebuilt, one at a time"
    tail = f"; {cleared} recorded refusals cleared" if cleared else ""
    chain = ", ".join(answer["profiles"])
    what = "back to its configured chain" if reset else f"down from {answer['from']}"
    workers = "its worker is" if answer["queued"] == 1 else f"its {answer['queued']} workers are"
    return (
        f"{answer['model']}: {what}; {workers} rebuilt with profiles [{chain}], one at a "
        f"time, each retired only once its successor serves; `infervisor status` shows the fallback{tail}"
    )


def run_fallback(args: argparse.Namespace) -> int:
    """Send fallback to the daemon and wait for the rollout (unless --no-wait): 0 done, 1 refused, 2 no daemon."""
    runtime_dir = resolve_runtime_dir(args.runtime_dir, None)
    command: dict[str, object] = {"cmd": "fallback", "model": args.model, "reset": args.reset}
    if args.reason:
        command["reason"] = args.reason
    try:
        answer = control_request(runtime_dir, command)
        states = wait_for_rollouts(runtime_dir, [args.model], args.timeout) if answer.get("ok") and args.wait else {}
    except ControlError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}) if args.json else f"infervisor fallback: {exc}",
              file=sys.stdout if args.json else sys.stderr)  # fmt: skip
        return EXIT_UNREACHABLE
    state = states.get(args.model, {})
    if args.json:
        print(json.dumps({**answer, **({"rollout": state} if state else {})}))
    else:
        print(describe(answer, args.reset), file=sys.stdout if answer.get("ok") else sys.stderr)
        if state:
            detail = f": {state['error']}" if state.get("error") else ""
            print(f"  {args.model}: {state['state']}{detail}")
    if not answer.get("ok"):
        return EXIT_REFUSED
    return EXIT_OK if not state or state.get("state") == "applied" else EXIT_REFUSED
