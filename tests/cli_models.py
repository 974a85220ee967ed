"""Models for the CLI tests, loaded by workers through the `python` source kind."""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings

import torch

#: One input row of a 224x224 RGB image: a batch of 100000 is 60 GB, far over any frame limit.
IMAGE_INPUTS = [{"name": "image", "dtype": "float32", "shape": [None, 3, 224, 224]}]
TINY_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 16]}]
#: What `noisy` warns and logs, for the test to find in the daemon's log.
WARNING_TEXT = "cli test: a UserWarning while the model builds"
TORCH_LOG_TEXT = "cli test: a record on torch's own logger"
LIBRARY_LOG_TEXT = "cli test: a record on a library logger without handlers"


class Pool(torch.nn.Module):
    """Mean of each channel: an image model that costs nothing to load."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return image.mean(dim=(2, 3))


class Echo(torch.nn.Module):
    """Returns its input plus one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def pool() -> torch.nn.Module:
    """Factory for config: {"python": "tests.cli_models:pool"}."""
    return Pool()


def noisy() -> torch.nn.Module:
    """Warns and logs while building, as torch, inductor and torchao do during a first start."""
    warnings.warn(WARNING_TEXT, UserWarning, stacklevel=1)
    logging.getLogger("torch").warning(TORCH_LOG_TEXT)  # torch installs a console handler on this one
    logging.getLogger("torchao.quantization").warning(LIBRARY_LOG_TEXT)  # reaches the root logger
    return Echo()


def staggered() -> torch.nn.Module:
    """Slot 0 builds at once, every other slot takes 4 s: the daemon is "ready" long before its pool is."""
    worker_id = json.loads(sys.argv[-1])["worker_id"]  # MODEL.SLOT.GENERATION
    if worker_id.split(".")[-2] != "0":
        time.sleep(4.0)
    return Echo()
