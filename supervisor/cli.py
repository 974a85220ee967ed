"""`infervisor` command line: serve, status, metrics, infer, restart, reload, demo, bench and the toolkit commands.

Each command's module is imported only when it runs, so `serve` starts without the toolkit's imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from infervisor.common.profiles import PROFILE_NAMES
from infervisor.protocol.constants import PROTOCOL_VERSION

RUNTIME_DIR_HELP = (
    "the daemon's socket directory (default: $RUNTIME_DIRECTORY, /run/infervisor, $XDG_RUNTIME_DIR/infervisor "
    "or /tmp/infervisor-UID, the first that applies; serve also honours the config's runtime_dir)"
)
#: The import names of the `server` extra (pyproject.toml): a client-only install (`pip install infervisor`)
#: has none of them, and every subcommand needs some (tests/test_client_install.py keeps the two in step).
SERVER_MODULES = frozenset({"torch", "psutil", "structlog", "watchdog", "prometheus_client"})
SERVER_HINT = "this command needs the daemon's dependencies: pip install 'infervisor[server]'"

CONFIG_HELP = (
    "config.json to use (default: $INFERVISOR_CONFIG, else /etc/infervisor/config.json when it exists, "
    "else the shipped configs/default.json)"
)


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their options; every option has a help text (tests/test_cli.py checks)."""
    parser = argparse.ArgumentParser(
        prog="infervisor", description="Serve PyTorch models on CPU workers.", formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    serve = command("serve", "run the daemon in the foreground")
    serve.add_argument("--config", help=CONFIG_HELP)
    serve.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    serve.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)

    status = command("status", "show the workers of a running daemon")
    status.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    status.add_argument("--json", action="store_true", help="print the raw status document")
    status.add_argument(
        "--check",
        action="store_true",
        help="for probes: print the state line only and exit 0 ready, 1 degraded, 2 starting/down/stopping/not running",
    )

    metrics = command("metrics", "print the daemon's Prometheus metrics (what a scrape of metrics_listen returns)")
    metrics.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)

    infer = command("infer", "send one request from the shell")
    infer.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    infer.add_argument("--model", required=True, help="the served model to ask (see `infervisor status`)")
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", action="append", help="FILE.npy, NAME=FILE.npy (repeatable) or FILE.npz")
    source.add_argument("--random", action="store_true", help="random inputs of the model's declared spec")
    infer.add_argument("--batch", type=_positive_int, default=1, help="size of dynamic dims with --random")
    infer.add_argument("--timeout", type=_positive_float, default=30.0, help="seconds to wait for the reply")
    infer.add_argument("--json", action="store_true", help="print the result (or the error) as one JSON object")

    restart = command("restart", "rolling restart of a model's workers (all models by default)")
    restart.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    restart.add_argument("--model", help="restart only this model's workers")
    restart.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")

    reload = command("reload", "re-read config.json now (it is also watched, and SIGHUP reloads)")
    reload.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    reload.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    reload.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the config is applied, before rollouts end"
    )
    reload.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the models' rollouts to finish"
    )

    fallback = command("fallback", "move a model one step down its validated chain, live and rolling (or back)")
    fallback.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    fallback.add_argument("--model", required=True, help="the served model to move")
    fallback.add_argument("--reset", action="store_true", help="back to the chain config.json gives the model")
    fallback.add_argument("--reason", help="why, shown in status and the log (default: operator command)")
    fallback.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the rollout is queued, before it ends"
    )
    fallback.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the rollout to finish")
    fallback.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")

    build = command("build", "fill the compiled-package cache for a config ahead of deployment, then exit")
    build.add_argument("--config", help=CONFIG_HELP)
    build.add_argument("--models", help="only these models of the config, comma-separated (default: all)")
    build.add_argument("--json", help="also write each profile's outcome here")

    demo = command("demo", "start the daemon, send it requests, print results and latency, stop it")
    demo.add_argument("--config", help=CONFIG_HELP)
    demo.add_argument("--runtime-dir", help="socket directory for the demo's daemon (default: a fresh temporary one)")
    demo.add_argument("--requests", type=_positive_int, default=50, help="requests per model, all clients together")
    demo.add_argument("--clients", type=_positive_int, default=2, help="concurrent clients per model")
    demo.add_argument(
        "--no-build", dest="build", action="store_false",
        help="skip `infervisor build` before the daemon starts (its workers then compile, showing their progress)",
    )  # fmt: skip
    demo.add_argument(
        "--start-timeout", type=_positive_float, default=600.0,
        help="seconds to wait for every worker to serve (a first start compiles the int8 packages)",
    )  # fmt: skip
    bench = command("bench", "every optimisation profile of a model, in process and via the daemon")
    bench.add_argument(
        "--models", default="resnet50,encoder", help="comma-separated: built-ins, or models of the config file"
    )
    bench.add_argument("--config", help=CONFIG_HELP + "; its models can be named in --models (and win over built-ins)")
    bench.add_argument("--profiles", default=",".join(PROFILE_NAMES), help="profiles to measure, comma-separated")
    bench.add_argument("--threads", default="1,2", help="thread counts, comma-separated (one pinned core each)")
    bench.add_argument("--batch", type=int, default=8, help="the second batch size measured (the batch column)")
    bench.add_argument("--seconds", type=float, default=3.0, help="timing per measurement")
    bench.add_argument("--channels-last", action="store_true", help="feed 4-D inputs in channels_last (NHWC)")
    bench.add_argument("--no-daemon", dest="daemon", action="store_false", help="in-process figures only")
    bench.add_argument("--cache-dir", help="compiled packages (default: the daemon's cache directory)")
    bench.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process / worker start")
    bench.add_argument("--json", help="also write the rows here")
    doctor = command("doctor", "the ten-point performance checklist on this box: pass / warn / fail")
    doctor.add_argument("--config", help=CONFIG_HELP)
    doctor.add_argument("--constraints", help="constraints.json of the delivery (see configs/constraints.example.json)")
    doctor.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    doctor.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    doctor.add_argument("--json", action="store_true", help="print the checks as a JSON list")
    optimize = command(
        "optimize", "measure every profile of a model at every layout, judge the SLA, write its chain and layout"
    )
    optimize.add_argument("--model", required=True, help="the configured model to measure")
    optimize.add_argument("--config", help=CONFIG_HELP + "; the chosen chain and layout are written into it")
    optimize.add_argument(
        "--constraints", help="constraints.json (accuracy budget and SLA); else the model's tolerance"
    )
    optimize.add_argument("--calibration", help=".npz for int8_static (written into the model's entry)")
    optimize.add_argument("--validation", help=".npz the accuracy is measured on (written into the model's entry)")
    optimize.add_argument("--profiles", default=",".join(PROFILE_NAMES), help="profiles to measure, comma-separated")
    optimize.add_argument(
        "--layouts", help="layouts to measure as WORKERSxCORES, comma-separated (default: every one that fits)"
    )
    optimize.add_argument("--threads", type=int, help="only layouts with this many cores (threads) per worker")
    optimize.add_argument("--batch", type=int, default=8, help="the second batch size measured")
    optimize.add_argument("--seconds", type=float, default=2.0, help="timing per profile and layout")
    optimize.add_argument("--cache-dir", help="compiled packages (default: the config's cache_dir)")
    optimize.add_argument("--timeout", type=float, default=1800.0, help="seconds per measuring process or daemon start")
    optimize.add_argument(
        "--no-check", dest="check", action="store_false",
        help="skip the final check of the choice through a real daemon (then the P99 reported is in process)",
    )  # fmt: skip
    optimize.add_argument(
        "--check-qps", type=float, help="QPS of the final check (default: the SLA's min_qps, else half the choice's)"
    )
    optimize.add_argument("--check-clients", type=int, default=2, help="clients of the final check (as probe's)")
    optimize.add_argument("--check-seconds", type=float, default=10.0, help="seconds of the final check (as probe's)")
    optimize.add_argument("--dry-run", action="store_true", help="show the config diff, write nothing")
    optimize.add_argument("--json", help="also write the report here")
    probe = command("probe", "per-stage timings, hardware counters and torch operators under load")
    probe.add_argument("--model", required=True, help="the served model to load")
    probe.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    probe.add_argument("--qps", type=float, default=20.0, help="offered load, all clients together")
    probe.add_argument("--duration", type=float, default=10.0, help="seconds")
    probe.add_argument("--clients", type=int, default=2, help="concurrent clients")
    probe.add_argument("--batch", type=int, default=1, help="rows per request")
    probe.add_argument("--profile-requests", type=int, default=50, help="requests one worker runs under torch.profiler")
    probe.add_argument("--json", help="also write the report here")
    harden = command("harden", "stability hardening against a running daemon: pass/fail per check")
    harden.add_argument("--model", required=True, help="the served model to harden")
    harden.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    harden.add_argument("--duration", type=float, default=60.0, help="seconds, split between the timed checks")
    harden.add_argument("--constraints", help="constraints.json: the soak's P99 limit")
    harden.add_argument("--hog-mb", type=int, default=512, help="memory the pressure check allocates")
    harden.add_argument("--no-chaos", dest="chaos", action="store_false", help="skip kill -9 / SIGSTOP of workers")
    harden.add_argument("--json", help="also write the results here")
    report = command("report", "one HTML report: verdict, constraints, doctor, optimize, probe, harden")
    report.add_argument("--config", help=CONFIG_HELP + "; for the doctor's checks")
    report.add_argument("--constraints", help="constraints.json of the delivery")
    report.add_argument("--optimize", help="JSON written by infervisor optimize --json")
    report.add_argument("--probe", help="JSON written by infervisor probe --json")
    report.add_argument("--harden", help="JSON written by infervisor harden --json")
    report.add_argument(
        "--out", default="infervisor-report.html", help="the HTML file to write (its charts as PNGs beside it)"
    )
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
    if args.command == "serve":
        from infervisor.supervisor.commands.serve import run_serve

        return run_serve(args)
    if args.command == "status":
        from infervisor.supervisor.commands.status import run_status

        return run_status(args)
    if args.command == "metrics":
        from infervisor.supervisor.commands.metrics import run_metrics

        return run_metrics(args)
    if args.command == "infer":
        from infervisor.supervisor.commands.infer import run_infer

        return run_infer(args)
    if args.command in ("restart", "reload"):
        from infervisor.supervisor.commands.ops import run_control

        return run_control(args)
    if args.command == "fallback":
        from infervisor.supervisor.commands.fallback import run_fallback

        return run_fallback(args)
    if args.command == "build":
        from infervisor.supervisor.commands.build import run_build

        return run_build(args)
    if args.command == "report":
        from infervisor.supervisor.commands.report import run_report

        return run_report(args)
    if args.command == "harden":
        from infervisor.supervisor.commands.harden import run_harden

        return run_harden(args)
    if args.command == "probe":
        from infervisor.supervisor.commands.probe import run_probe

        return run_probe(args)
    if args.command == "optimize":
        from infervisor.supervisor.commands.optimize import run_optimize

        return run_optimize(args)
    if args.command == "doctor":
        from infervisor.supervisor.commands.doctor import run_doctor

        return run_doctor(args)
    if args.command == "bench":
        from infervisor.supervisor.commands.bench import run_bench

        return run_bench(args)
    from infervisor.supervisor.commands.demo import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
