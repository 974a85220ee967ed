"""`infervisor` command line: serve, status, infer, restart, reload, demo, bench and the toolkit commands.

Each command's module is imported only when it runs, so `serve` starts without the toolkit's imports.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from common.profiles import PROFILE_NAMES


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their options."""
    parser = argparse.ArgumentParser(prog="infervisor", description="Serve PyTorch models on CPU workers.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", required=True, help="path to config.json")
    serve.add_argument("--runtime-dir", help="directory for the sockets (default: see docs)")
    serve.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)

    status = sub.add_parser("status", help="show the workers of a running daemon")
    status.add_argument("--runtime-dir")
    status.add_argument("--json", action="store_true", help="print the raw status document")

    infer = sub.add_parser("infer", help="send one request from the shell")
    infer.add_argument("--runtime-dir")
    infer.add_argument("--model", required=True)
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", action="append", help="FILE.npy, NAME=FILE.npy (repeatable) or FILE.npz")
    source.add_argument("--random", action="store_true", help="random inputs of the model's declared spec")
    infer.add_argument("--batch", type=int, default=1, help="size of dynamic dims with --random")
    infer.add_argument("--timeout", type=float, default=30.0)
    infer.add_argument("--json", action="store_true")

    restart = sub.add_parser("restart", help="rolling restart of a model's workers (all models by default)")
    restart.add_argument("--runtime-dir")
    restart.add_argument("--model")

    reload = sub.add_parser("reload", help="re-read config.json now (it is also watched, and SIGHUP reloads)")
    reload.add_argument("--runtime-dir")

    demo = sub.add_parser("demo", help="start the daemon, send it requests, print results and latency, stop it")
    demo.add_argument("--config", default="configs/default.json")
    demo.add_argument("--runtime-dir")
    demo.add_argument("--requests", type=int, default=50)
    demo.add_argument("--clients", type=int, default=2)
    bench = sub.add_parser("bench", help="every optimisation profile of a built-in, in process and via the daemon")
    bench.add_argument("--models", default="resnet50,encoder", help="built-ins, comma-separated")
    bench.add_argument("--profiles", default=",".join(PROFILE_NAMES))
    bench.add_argument("--threads", default="1,2", help="thread counts, comma-separated (one pinned core each)")
    bench.add_argument("--batch", type=int, default=8, help="the second batch size measured")
    bench.add_argument("--seconds", type=float, default=3.0, help="timing per measurement")
    bench.add_argument("--channels-last", action="store_true")
    bench.add_argument("--no-daemon", dest="daemon", action="store_false", help="in-process figures only")
    bench.add_argument("--cache-dir", help="compiled packages (default: the daemon's cache directory)")
    bench.add_argument("--timeout", type=float, default=1800.0, help="per child process / worker start")
    bench.add_argument("--json", help="also write the rows here")
    doctor = sub.add_parser("doctor", help="the ten-point performance checklist on this box: pass / warn / fail")
    doctor.add_argument("--config", default="configs/default.json")
    doctor.add_argument("--constraints", help="constraints.json of the delivery (see configs/constraints.example.json)")
    doctor.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    doctor.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    doctor.add_argument("--json", action="store_true")
    optimize = sub.add_parser("optimize", help="measure every profile of a model, judge the SLA, write its chain")
    optimize.add_argument("--model", required=True)
    optimize.add_argument("--config", default="configs/default.json")
    optimize.add_argument(
        "--constraints", help="constraints.json (accuracy budget and SLA); else the model's tolerance"
    )
    optimize.add_argument("--calibration", help=".npz for int8_static (written into the model's entry)")
    optimize.add_argument("--validation", help=".npz the accuracy is measured on (written into the model's entry)")
    optimize.add_argument("--profiles", default=",".join(PROFILE_NAMES))
    optimize.add_argument("--threads", type=int, help="threads per worker (default: the model's)")
    optimize.add_argument("--batch", type=int, default=8)
    optimize.add_argument("--seconds", type=float, default=2.0, help="timing per profile")
    optimize.add_argument("--cache-dir", help="compiled packages (default: the config's cache_dir)")
    optimize.add_argument("--timeout", type=float, default=1800.0)
    optimize.add_argument("--dry-run", action="store_true", help="show the config diff, write nothing")
    optimize.add_argument("--json", help="also write the report here")
    probe = sub.add_parser("probe", help="per-stage timings, hardware counters and torch operators under load")
    probe.add_argument("--model", required=True)
    probe.add_argument("--runtime-dir")
    probe.add_argument("--qps", type=float, default=20.0, help="offered load, all clients together")
    probe.add_argument("--duration", type=float, default=10.0, help="seconds")
    probe.add_argument("--clients", type=int, default=2)
    probe.add_argument("--batch", type=int, default=1)
    probe.add_argument("--profile-requests", type=int, default=50, help="requests one worker runs under torch.profiler")
    probe.add_argument("--json", help="also write the report here")
    harden = sub.add_parser("harden", help="stability hardening against a running daemon: pass/fail per check")
    harden.add_argument("--model", required=True)
    harden.add_argument("--runtime-dir")
    harden.add_argument("--duration", type=float, default=60.0, help="seconds, split between the timed checks")
    harden.add_argument("--constraints", help="constraints.json: the soak's P99 limit")
    harden.add_argument("--hog-mb", type=int, default=512, help="memory the pressure check allocates")
    harden.add_argument("--no-chaos", dest="chaos", action="store_false", help="skip kill -9 / SIGSTOP of workers")
    harden.add_argument("--json", help="also write the results here")
    report = sub.add_parser("report", help="one HTML report: verdict, constraints, doctor, optimize, probe, harden")
    report.add_argument("--config", default="configs/default.json", help="for the doctor's checks")
    report.add_argument("--constraints")
    report.add_argument("--optimize", help="JSON written by infervisor optimize --json")
    report.add_argument("--probe", help="JSON written by infervisor probe --json")
    report.add_argument("--harden", help="JSON written by infervisor harden --json")
    report.add_argument("--out", default="infervisor-report.html")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from supervisor.commands.serve import run_serve

        return run_serve(args)
    if args.command == "status":
        from supervisor.commands.status import run_status

        return run_status(args)
    if args.command == "infer":
        from supervisor.commands.infer import run_infer

        return run_infer(args)
    if args.command in ("restart", "reload"):
        from supervisor.commands.ops import run_control

        return run_control(args)
    if args.command == "report":
        from supervisor.commands.report import run_report

        return run_report(args)
    if args.command == "harden":
        from supervisor.commands.harden import run_harden

        return run_harden(args)
    if args.command == "probe":
        from supervisor.commands.probe import run_probe

        return run_probe(args)
    if args.command == "optimize":
        from supervisor.commands.optimize import run_optimize

        return run_optimize(args)
    if args.command == "doctor":
        from supervisor.commands.doctor import run_doctor

        return run_doctor(args)
    if args.command == "bench":
        from supervisor.commands.bench import run_bench

        return run_bench(args)
    from supervisor.commands.demo import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
