"""Cold-path benchmark: what the steps that answer a request cost right after a forward pass, against warm.

    python bench/cold_path.py [--models tiny,resnet18] [--rounds 80]

A served request pays for code that an in-process call never runs: after the forward pass the
worker encodes the result and writes it to its link, the kernel wakes the supervisor, and so on to
the client. An fp32 resnet18 pass streams about 47 MB of weights through a core's 1 MiB L2 and the
shared 32 MiB L3 of this machine, so those steps find their code and data (Python's and the
kernel's) evicted and run several times slower than when repeated at once. That is a floor under
any out-of-process server of this model here, ours or the bare pyzmq broker, and no transport
change removes it.

Each round runs one forward pass, then a step twice: the first run is "after forward", the second
"warm". The `broker:` rows run the supervisor's own per-request calls the same way: its caches are
emptied too, by the model on the shared L3 and by the 600 KB copies through its own core. One
process pinned to one CPU, one torch thread, as a worker. `tiny` (a 16x16 Linear) evicts almost
nothing, so its ratios show what the method itself reads as cold. One run, one machine:
compare ratios within the table, not absolutes across runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infervisor.supervisor.observe.stats import percentile  # noqa: E402

#: Input shapes of the models this drives (batch 1).
_SHAPES = {"tiny": (1, 16), "resnet18": (1, 3, 224, 224), "resnet50": (1, 3, 224, 224)}
#: Rounds per step before timing starts: first calls, allocator growth.
_WARMUP = 10


def pin_to_one_cpu() -> int:
    """Pin this process to its last allowed CPU and size torch's pools to one thread, before torch loads."""
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    return cpu


def _nothing() -> None:
    """No clean-up."""


def reply_steps() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """The worker's post-model steps by name, each a real call into the project's code, and an untimed clean-up."""
    import numpy as np

    from infervisor.protocol import worker_messages as wm
    from infervisor.protocol.client_messages import encode_result
    from infervisor.protocol.constants import TIMING_KEYS
    from infervisor.protocol.tensors import TensorDesc
    from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = Link(ours, WORKER_LINK_FRAMES, 2**30)
    receiver = Link(theirs, WORKER_LINK_FRAMES, 2**30)
    logits = np.zeros((1, 1000), dtype=np.float32)
    outputs = [TensorDesc("logits", "float32", logits.shape)]
    timing = dict.fromkeys(TIMING_KEYS, 1.0)

    def header() -> bytes:
        return encode_result(1, "resnet18", outputs, timing)

    def reply() -> None:
        sender.send(wm.encode(wm.Reply(1, None, ""), [header(), logits]))

    def drain() -> None:
        got: list[list[memoryview]] = []
        while len(got) < 2:  # the step ran twice: after the forward pass, then warm
            got += receiver.receive()

    return {
        "one syscall (getppid)": (os.getppid, _nothing),
        "result header (encode_result)": (header, _nothing),
        "worker reply: header, link send": (reply, drain),
    }


def broker_steps() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """The broker's own checks and codec calls on a 600 KB image request, for comparison (same cache state)."""
    from infervisor.protocol import worker_messages as wm
    from infervisor.protocol.client_messages import InferRequest, decode_infer, encode_infer
    from infervisor.protocol.tensors import TensorDesc, TensorSpec, check_against_spec

    desc = TensorDesc("image", "float32", (1, 3, 224, 224))
    header = encode_infer(InferRequest(12345, "resnet18", (desc,), 30_000))
    specs = (TensorSpec("image", "float32", (None, 3, 224, 224)),)
    inputs = (desc,)
    reply = wm.encode(wm.Reply(17, None, ""))[0]
    return {
        "broker: decode the client header": (lambda: decode_infer(header, [desc.nbytes], 2**30), _nothing),
        "broker: check against the spec": (lambda: check_against_spec(inputs, specs), _nothing),
        "broker: encode REQUEST": (lambda: wm.encode(wm.Request(17, 1.0, 1.0, 0.01)), _nothing),
        "broker: decode REPLY": (lambda: wm.decode(reply), _nothing),
    }


def measure(model_name: str, rounds: int) -> list[tuple[str, list[float], list[float]]]:
    """Per step: microseconds right after a forward pass, and repeated at once."""
    import torch

    from infervisor.worker.models import build_builtin

    torch.set_num_threads(1)
    model = build_builtin(model_name).eval()
    example = torch.randn(*_SHAPES[model_name])
    steps = reply_steps() | broker_steps()
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in steps}
    with torch.inference_mode():
        for index in range(rounds + _WARMUP):
            for name, (step, clean_up) in steps.items():
                model(example)
                started = time.perf_counter()
                step()
                cold_done = time.perf_counter()
                step()
                warm_done = time.perf_counter()
                clean_up()
                if index >= _WARMUP:
                    results[name][0].append((cold_done - started) * 1e6)
                    results[name][1].append((warm_done - cold_done) * 1e6)
    return [(name, cold, warm) for name, (cold, warm) in results.items()]


def main() -> int:
    """Measure every model and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,resnet18")
    parser.add_argument("--rounds", type=int, default=80)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(_SHAPES))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(_SHAPES)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    cpu = pin_to_one_cpu()
    print(f"one process on cpu {cpu}, 1 torch thread, {args.rounds} rounds per step; times in us")
    print(f"{'model':9s} {'step':34s} {'after p50':>10s} {'p99':>8s} {'warm p50':>9s} {'p99':>8s} {'ratio p50':>10s}")
    for model in models:
        for name, cold, warm in measure(model, args.rounds):
            cold_p50, warm_p50 = percentile(cold, 50) or 0.0, percentile(warm, 50) or 0.0
            ratio = cold_p50 / warm_p50 if warm_p50 else float("nan")
            print(
                f"{model:9s} {name:34s} {cold_p50:10.1f} {percentile(cold, 99) or 0.0:8.1f} "
                f"{warm_p50:9.1f} {percentile(warm, 99) or 0.0:8.1f} {ratio:9.1f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
