"""`infervisor restart` and `infervisor reload`: operator commands over the control socket."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from infervisor.protocol.control_client import ControlError, control_request
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir

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
        if answer.get("queued"):
            return (
                f"reload queued: the daemon re-reads {config_path or 'its config.json'} once its current "
                "drain-first step is done; `infervisor status` shows what was applied"
            )
        rolling = answer.get("rolling") or []
        changed = ", ".join(sorted(answer.get("diff") or {})) or "nothing changed"
        if not rolling:
            return f"reload applied ({changed})"
        return f"reload applied ({changed}); rolling out: {', '.join(rolling)}"
    queued = int(answer.get("queued", 0))
    which = f"model {model}" if model else "every model"
    if queued == 0:
        return f"nothing to restart: {which} has no worker"
    workers = "worker" if queued == 1 else "workers"
    return (
        f"restart queued: {queued} {workers} of {which}, replaced one at a time, each retired only once its "
        "successor serves; `infervisor status` shows the progress"
    )


def wait_for_rollouts(runtime_dir: Path, models: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Poll status until none of `models` is still rolling out (or `timeout`); their final config states."""
    deadline = time.monotonic() + timeout
    while True:
        states: dict[str, dict[str, Any]] = control_request(runtime_dir, {"cmd": "status"})["config"]["models"]
        wanted = {m: states.get(m, {"state": "removed"}) for m in models}
        if all(s.get("state") != "rolling" for s in wanted.values()) or time.monotonic() > deadline:
            return wanted
        time.sleep(0.2)


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
    if args.json and not (ok and args.command == "reload" and args.wait and answer.get("rolling")):
        print(json.dumps(answer))
    elif ok:
        print(describe(args.command, model, answer, _config_path(runtime_dir) if args.command == "reload" else ""))
    else:
        print(describe(args.command, model, answer), file=sys.stderr)
        for problem in answer.get("problems") or []:
            print(f"  {problem}", file=sys.stderr)
    if ok and args.command == "reload" and args.wait and answer.get("rolling"):
        return _report_rollouts(args, runtime_dir, answer)
    return EXIT_OK if ok else EXIT_REFUSED


def _report_rollouts(args: argparse.Namespace, runtime_dir: Path, answer: dict[str, Any]) -> int:
    """Wait for the reload's rollouts and say how each ended: 0 all applied, 1 one failed or timed out."""
    try:
        states = wait_for_rollouts(runtime_dir, list(answer["rolling"]), args.timeout)
    except ControlError as exc:
        print(f"infervisor reload: lost the daemon while waiting: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps({**answer, "models": states}))
    else:
        for name, state in states.items():
            detail = f": {state['error']}" if state.get("error") else ""
            print(f"  {name}: {state['state']}{detail}", file=sys.stdout if state["state"] == "applied" else sys.stderr)
    return EXIT_OK if all(s["state"] == "applied" for s in states.values()) else EXIT_REFUSED
