"""Eager models that misbehave on request, loaded by workers through the `python` source kind.

Input `x` float32[N, 2]: x[0, 0] picks the behaviour, x[0, 1] is its argument; N only adds payload.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import time

import numpy as np
import torch

FAULT_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 2]}]

# Far from the N(0, 1) values that warm-up feeds the model, so warm-up only ever echoes.
ECHO, SEGFAULT, SLEEP, EXIT, ALLOCATE, LEAK, SLOW, CORRUPT, GROW = 0, 101, 102, 103, 104, 105, 106, 107, 108
GARBLE = 109


class Faulty(torch.nn.Module):
    """Echoes its input, or crashes, sleeps, exits, allocates, leaks, slows, corrupts itself or its link on request."""

    #: GROW leaks this many MB per step, one step per 50 ms: a request whose memory climbs while it runs.
    GROW_STEP_MB = 50

    def __init__(self) -> None:
        super().__init__()
        self.leaked: list[torch.Tensor] = []
        self.delay = 0.0
        self.offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        command, argument = int(x[0, 0]), float(x[0, 1])
        if command == LEAK:
            self.leaked.append(torch.ones(int(argument * 2**20) // 4))  # argument MB, kept for ever
        elif command == SLOW:
            self.delay = argument  # every later request takes this much longer
        elif command == GROW:
            for _ in range(int(argument) // self.GROW_STEP_MB):
                self.leaked.append(torch.ones(self.GROW_STEP_MB * 2**20 // 4))
                time.sleep(0.05)
        elif command == CORRUPT:
            self.offset += argument  # later outputs shift: a canary must notice
        elif command == GARBLE:
            # A frame count of zero on the worker's link, as a stray write into its socket would make.
            os.write(json.loads(sys.argv[-1])["link_fd"], struct.pack("<I", 0))
        if command == SEGFAULT:
            ctypes.string_at(0)  # reads address 0: SIGSEGV, as a buggy native op would
        elif command == SLEEP:
            time.sleep(argument)
        elif command == EXIT:
            os._exit(int(argument))
        elif command == ALLOCATE:
            hog = torch.ones(int(argument * 2**30) // 4)  # argument GiB, touched
            return x[:1] + hog[:1]
        if self.delay:
            time.sleep(self.delay)
        return x[:1] + self.offset


def faulty() -> torch.nn.Module:
    """Factory for config: {"python": "tests.fault_models:faulty"}."""
    return Faulty()


def broken() -> torch.nn.Module:
    """A factory that fails to build its model, as a missing weights file would."""
    raise FileNotFoundError("weights.bin not found")


def unsteady() -> torch.nn.Module:
    """A factory that fails differently each time, as a flaky download would: a crash loop, not one repeated error."""
    raise ConnectionError(f"download interrupted after {os.getpid()} bytes")


def command(kind: int, argument: float = 0.0) -> dict[str, np.ndarray]:
    """The request input for one behaviour."""
    return {"x": np.array([[kind, argument]], dtype=np.float32)}


class RowSlow(torch.nn.Module):
    """Takes 20 ms per row of its input, in warm-up too: a model whose time grows with the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02 * x.shape[0])
        return x[:1]


def rowslow() -> torch.nn.Module:
    """Factory for config: {"python": "tests.fault_models:rowslow"}."""
    return RowSlow()


class CrashesWhenTraced(torch.nn.Module):
    """Doubles its input, but dies of SIGSEGV when torch.jit traces it: a native crash under one profile only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            ctypes.string_at(0)
        return x * 2


def crashes_when_traced() -> torch.nn.Module:
    """Factory for config: {"python": "tests.fault_models:crashes_when_traced"}."""
    return CrashesWhenTraced()


#: While this file exists, tracing SlowWhenTraced sleeps (a test turns a slow build on and off).
SLOW_TRACE_FLAG = "INFERVISOR_TEST_SLOW_TRACE"


class SlowWhenTraced(torch.nn.Module):
    """Doubles its input; tracing it (the jit profile's build) sleeps 120 s while $INFERVISOR_TEST_SLOW_TRACE exists."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flag = os.environ.get(SLOW_TRACE_FLAG)
        if torch.jit.is_tracing() and flag and os.path.exists(flag):
            time.sleep(120)
        return x * 2


def slow_when_traced() -> torch.nn.Module:
    """Factory for config: {"python": "tests.fault_models:slow_when_traced"}."""
    return SlowWhenTraced()


class DriftsWhenTraced(torch.nn.Module):
    """Doubles its input; its traced graph adds fresh noise (1e-2) on every call: jit drifts, eager does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            return x * 2 + torch.rand(x.shape) * 1e-2  # recorded as an op: every run of the graph draws again
        return x * 2


def drifts_when_traced() -> torch.nn.Module:
    """Factory for config: {"python": "tests.fault_models:drifts_when_traced"}."""
    return DriftsWhenTraced()


ROW_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, None]}]


class RowFaulty(torch.nn.Module):
    """Row-wise: each output row is its input row plus one, and each row alone can crash or stall the worker.

    A row whose x[i, 0] is SEGFAULT kills the process, SLEEP sleeps x[i, 1] seconds: a batch carrying
    such a row fails (or stalls) every request joined with it, as a poison input would.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == SEGFAULT).any()):
            ctypes.string_at(0)
        stall = x[x[:, 0] == SLEEP]
        if stall.shape[0]:
            time.sleep(float(stall[:, 1].max()))
        return x + 1.0


def rowfaulty() -> torch.nn.Module:
    """Factory for config: {"python": "tests.fault_models:rowfaulty"}."""
    return RowFaulty()
