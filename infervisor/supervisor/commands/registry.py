"""The CLI's commands, one table: each command's name, help line, options and handler.

A handler is named as `module:function` and imported only when its command runs, so `serve` starts
without the toolkit's imports and a client-only install still parses every command. Adding a command
is its module under `infervisor/supervisor/commands/` (a `run_NAME(args) -> int`) and one `CLI_COMMANDS` entry
here with its options function (every option with a help text: tests/test_cli.py checks).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from infervisor.common.profiles import PROFILE_NAMES

#: The package whose modules hold the handlers.
_HERE = __name__.rpartition(".")[0]

RUNTIME_DIR_HELP = (
    "the daemon's socket directory (default: $RUNTIME_DIRECTORY, /run/infervisor, $XDG_RUNTIME_DIR/infervisor "
    "or /tmp/infervisor-UID, the first that applies; serve also honours the config's runtime_dir)"
)
CONFIG_HELP = (
    "config.json to use (default: $INFERVISOR_CONFIG, else /etc/infervisor/config.json when it exists, "
    "else the shipped configs/default.json)"
)


@dataclass(frozen=True)
class CliCommand:
    """One subcommand: its name and help line, the function adding its options, and its handler's `module:function`."""

    name: str
    help: str
    add_options: Callable[[argparse.ArgumentParser], None]
    handler: str


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


def _serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument(
        "--source-dir",
        help="the folder a model's relative files and python modules are found in (default: the config's folder); "
        "optimize and bench serve a scratch copy of your config with your config's folder here",
    )
    parser.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)


def _status_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--json", action="store_true", help="print the raw status document")
    parser.add_argument(
        "--check",
        action="store_true",
        help="for probes: print the state line only and exit 0 ready, 1 degraded, 2 starting/down/stopping/not running",
    )


def _metrics_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)


def _infer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--model", required=True, help="the served model to ask (see `infervisor status`)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", action="append", help="FILE.npy, NAME=FILE.npy (repeatable) or FILE.npz")
    source.add_argument("--random", action="store_true", help="random inputs of the model's declared spec")
    parser.add_argument("--batch", type=_positive_int, default=1, help="size of dynamic dims with --random")
    parser.add_argument("--timeout", type=_positive_float, default=30.0, help="seconds to wait for the reply")
    parser.add_argument("--json", action="store_true", help="print the result (or the error) as one JSON object")


def _restart_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--model", help="restart only this model's workers")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")


def _reload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    parser.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the config is applied, before rollouts end"
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the models' rollouts to finish"
    )


def _fallback_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--model", required=True, help="the served model to move")
    parser.add_argument("--reset", action="store_true", help="back to the chain config.json gives the model")
    parser.add_argument("--reason", help="why, shown in status and the log (default: operator command)")
    parser.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the rollout is queued, before it ends"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the rollout to finish")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")


def _build_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument("--models", help="only these models of the config, comma-separated (default: all)")
    parser.add_argument("--json", help="also write each profile's outcome here")
    parser.add_argument(
        "--export", metavar="FILE",
        help="after building, write the cache's packages, picks and the build's refusals to FILE, even when a "
             "profile did not build",
    )  # fmt: skip
    parser.add_argument("--sign", metavar="KEYFILE", help="with --export: sign the bundle with this ed25519 key")
    parser.add_argument(
        "--import", dest="import_bundle", metavar="FILE",
        help="build nothing: verify the bundle FILE (signed by a key of bundle_keys) and install what matches this "
             "box into the config's cache_dir",
    )  # fmt: skip
    parser.add_argument(
        "--allow-unsigned", action="store_true",
        help="with --import: accept a bundle that is unsigned or signed by a key not in bundle_keys",
    )  # fmt: skip
    parser.add_argument(
        "--keygen", metavar="PREFIX",
        help="build nothing: write a new signing key pair PREFIX.key (private, 0600) and PREFIX.pub",
    )  # fmt: skip


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument("--runtime-dir", help="socket directory for the demo's daemon (default: a fresh temporary one)")
    parser.add_argument("--requests", type=_positive_int, default=50, help="requests per model, all clients together")
    parser.add_argument("--clients", type=_positive_int, default=2, help="concurrent clients per model")
    parser.add_argument(
        "--notes", action="store_true",
        help="print under the worker table why each worker serves its profile (what was built, checked, skipped)",
    )  # fmt: skip
    parser.add_argument(
        "--build", action="store_true",
        help="run `infervisor build` before the daemon starts (by default the daemon serves first and builds behind)",
    )  # fmt: skip
    parser.add_argument(
        "--start-timeout", type=_positive_float, default=600.0,
        help="seconds to wait for every worker to serve (they serve from what is ready: seconds)",
    )  # fmt: skip
    parser.add_argument(
        "--switch-timeout", type=float, default=1800.0,
        help="seconds to wait for the background builder's pick to serve, then load it again (0: do not wait)",
    )  # fmt: skip


def _bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="resnet50,encoder", help="comma-separated: built-ins, or models of the config file"
    )
    parser.add_argument("--config", help=CONFIG_HELP + "; its models can be named in --models (and win over built-ins)")
    parser.add_argument("--profiles", default=",".join(PROFILE_NAMES), help="profiles to measure, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (one pinned core each)")
    parser.add_argument("--batch", type=int, default=8, help="the second batch size measured (the batch column)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per measurement")
    parser.add_argument("--channels-last", action="store_true", help="feed 4-D inputs in channels_last (NHWC)")
    parser.add_argument("--constraints", help="constraints.json: a configured model is measured at its data.inputs")
    parser.add_argument("--no-daemon", dest="daemon", action="store_false", help="in-process figures only")
    parser.add_argument("--cache-dir", help="compiled packages (default: the daemon's cache directory)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process / worker start")
    parser.add_argument("--json", help="also write the rows here")


def _doctor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=CONFIG_HELP + "; without it, the config of --optimize's JSON when given")
    parser.add_argument(
        "--optimize", help="JSON of infervisor optimize --json: check the config it wrote (else the one it read)"
    )
    parser.add_argument("--constraints", help="constraints.json of the delivery (see configs/constraints.example.json)")
    parser.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    parser.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list")


def _optimize_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the configured model to measure")
    parser.add_argument("--config", help=CONFIG_HELP + "; the chosen chain and layout are written into it")
    parser.add_argument("--constraints", help="constraints.json (accuracy budget and SLA); else the model's tolerance")
    parser.add_argument("--calibration", help=".npz for int8_static (written into the model's entry)")
    parser.add_argument("--validation", help=".npz the accuracy is measured on (written into the model's entry)")
    parser.add_argument("--profiles", default=",".join(PROFILE_NAMES), help="profiles to measure, comma-separated")
    parser.add_argument(
        "--layouts", help="layouts to measure as WORKERSxCORES, comma-separated (default: every one that fits)"
    )
    parser.add_argument("--threads", type=int, help="only layouts with this many cores (threads) per worker")
    parser.add_argument("--batch", type=int, default=8, help="the second batch size measured")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per profile and layout")
    parser.add_argument("--cache-dir", help="compiled packages (default: the config's cache_dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measuring process or daemon start")
    parser.add_argument(
        "--no-check", dest="check", action="store_false",
        help="skip the final check of the choice through a real daemon (then the P99 reported is in process)",
    )  # fmt: skip
    parser.add_argument(
        "--check-qps", type=float, help="QPS of the final check (default: the SLA's min_qps, else half the choice's)"
    )
    parser.add_argument("--check-clients", type=int, default=2, help="clients of the final check (as probe's)")
    parser.add_argument("--check-seconds", type=float, default=10.0, help="seconds of the final check (as probe's)")
    parser.add_argument("--dry-run", action="store_true", help="show the config diff, write nothing")
    parser.add_argument("--json", help="also write the report here")


def _probe_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the served model to load")
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--qps", type=float, default=20.0, help="offered load, all clients together")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients")
    parser.add_argument("--batch", type=int, default=1, help="rows per request")
    parser.add_argument(
        "--profile-requests", type=int, default=50, help="requests one worker runs under torch.profiler"
    )
    parser.add_argument("--json", help="also write the report here")


def _harden_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the served model to harden")
    parser.add_argument("--runtime-dir", help=RUNTIME_DIR_HELP)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds, split between the timed checks")
    parser.add_argument("--constraints", help="constraints.json: the soak's P99 limit")
    parser.add_argument("--hog-mb", type=int, default=512, help="memory the pressure check allocates")
    parser.add_argument("--no-chaos", dest="chaos", action="store_false", help="skip kill -9 / SIGSTOP of workers")
    parser.add_argument("--json", help="also write the results here")


def _report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help=CONFIG_HELP + "; the config the report signs and the doctor checks (default: the one --optimize's JSON "
        "wrote, else the one it read)",
    )
    parser.add_argument("--constraints", help="constraints.json of the delivery")
    parser.add_argument("--optimize", help="JSON written by infervisor optimize --json")
    parser.add_argument("--probe", help="JSON written by infervisor probe --json")
    parser.add_argument("--harden", help="JSON written by infervisor harden --json")
    parser.add_argument(
        "--out", default="infervisor-report.html", help="the HTML file to write (its charts as PNGs beside it)"
    )


#: In the order `infervisor --help` lists them.
CLI_COMMANDS: Mapping[str, CliCommand] = {
    command.name: command
    for command in (
        CliCommand("serve", "run the daemon in the foreground", _serve_options, f"{_HERE}.serve:run_serve"),
        CliCommand("status", "show the workers of a running daemon", _status_options, f"{_HERE}.status:run_status"),
        CliCommand(
            "metrics",
            "print the daemon's Prometheus metrics (what a scrape of metrics_listen returns)",
            _metrics_options,
            f"{_HERE}.metrics:run_metrics",
        ),
        CliCommand("infer", "send one request from the shell", _infer_options, f"{_HERE}.infer:run_infer"),
        CliCommand(
            "restart",
            "rolling restart of a model's workers (all models by default)",
            _restart_options,
            f"{_HERE}.ops:run_control",
        ),
        CliCommand(
            "reload",
            "re-read config.json now (it is also watched, and SIGHUP reloads)",
            _reload_options,
            f"{_HERE}.ops:run_control",
        ),
        CliCommand(
            "fallback",
            "move a model one step down its validated chain, live and rolling (or back)",
            _fallback_options,
            f"{_HERE}.fallback:run_fallback",
        ),
        CliCommand(
            "build",
            "fill the compiled-package cache for a config ahead of deployment, then exit",
            _build_options,
            f"{_HERE}.build:run_build",
        ),
        CliCommand(
            "demo",
            "start the daemon, send it requests, print results and latency, stop it",
            _demo_options,
            f"{_HERE}.demo:run_demo",
        ),
        CliCommand(
            "bench",
            "every optimisation profile of a model, in process and via the daemon",
            _bench_options,
            f"{_HERE}.bench:run_bench",
        ),
        CliCommand(
            "doctor",
            "the 14-point performance checklist on this box (seed 1's, grown): pass / warn / fail",
            _doctor_options,
            f"{_HERE}.doctor:run_doctor",
        ),
        CliCommand(
            "optimize",
            "measure every profile of a model at every layout, judge the SLA, write its chain and layout",
            _optimize_options,
            f"{_HERE}.optimize:run_optimize",
        ),
        CliCommand(
            "probe",
            "per-stage timings, hardware counters and torch operators under load",
            _probe_options,
            f"{_HERE}.probe:run_probe",
        ),
        CliCommand(
            "harden",
            "stability hardening against a running daemon: pass/fail per check",
            _harden_options,
            f"{_HERE}.harden:run_harden",
        ),
        CliCommand(
            "report",
            "one HTML report: verdict, constraints, doctor, optimize, probe, harden",
            _report_options,
            f"{_HERE}.report:run_report",
        ),
    )
}
