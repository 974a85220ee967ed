"""Test models for the gate's evidence, its advice and int8 on parametrized layers (`tests.evidence_models:X`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional


def weight_normed(old_style: bool = False) -> nn.Module:
    """Two Linear layers, each under weight_norm (torch.nn.utils.parametrizations, or the deprecated hook form)."""
    torch.manual_seed(0)
    wrap = nn.utils.weight_norm if old_style else nn.utils.parametrizations.weight_norm
    return nn.Sequential(wrap(nn.Linear(16, 32)), nn.ReLU(), wrap(nn.Linear(32, 4))).eval()


class PaddedAudio(nn.Module):
    """Raw audio with an open length: a reflect pad of 432 samples on each side (an STFT front end), then a strided
    conv and a mean over time; torch refuses any length up to 432 with its raw padding error."""

    PAD = 432

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 64, stride=32)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        padded = functional.pad(samples.unsqueeze(1), (self.PAD, self.PAD), mode="reflect")
        return self.conv(padded).mean(-1)


def padded_audio() -> nn.Module:
    """The factory the config names (seeded weights)."""
    torch.manual_seed(0)
    return PaddedAudio().eval()


class EveryTwelfth(nn.Module):
    """Doubles lengths that are multiples of 12: traced at 12, export holds at 12 alone; traced at 13, for 13..23."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 12 == 0:
            x = x * 2
        return self.head(x.sum(-1, keepdim=True))


def every_twelfth() -> nn.Module:
    """The factory the config names (seeded weights)."""
    torch.manual_seed(0)
    return EveryTwelfth().eval()


#: How far the traced (`jit`) graph of OffWhenTraced moves an output row whose first input value is 1 or more: 5%.
OFF_BY = 0.05
OFF_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 8]}]


class OffWhenTraced(nn.Module):
    """16 tanh features; the traced graph (the `jit` profile) scales each by 1 +- OFF_BY * clamp(x[:, 0], 0, 1), signs
    fixed per feature: exact on rows whose first value is at most 0, 5% off (cosine about 0.9988) where it is 1 or more,
    as a compiled profile right on its validation set and wrong on traffic it did not hold."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.features = nn.Linear(8, 16)
        with torch.no_grad():
            for parameter in self.features.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        signs = torch.randint(0, 2, (16,), generator=generator).float() * 2 - 1
        self.register_buffer("signs", signs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.features(x))
        if torch.jit.is_tracing():
            y = y * (1 + OFF_BY * x[:, :1].clamp(0, 1) * self.signs)
        return y


def off_when_traced() -> nn.Module:
    """The factory the config names."""
    return OffWhenTraced().eval()


class LongerThan74(nn.Module):
    """Doubles inputs longer than 74: traced at 12, export bounds the length to [12, 74] in its range constraints."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 74:
            x = x * 2
        return x.sum(-1, keepdim=True)


#: The lift OffInBf16 adds and takes away again per unit of a row's first value (from 1, bf16 keeps multiples of 8).
LIFT = 1000.0


class OffInBf16(nn.Module):
    """16 tanh features, plus and minus a lift of LIFT x clamp(x[:, 0], 0): in fp32 the lift cancels exactly; under bf16
    autocast (the `bf16` profile, an 8-bit mantissa) features + lift keeps multiples of 8 only, so the features are
    lost on rows whose first value is 1 or more, while rows whose first value is at most 0 lift nothing and stay within
    bf16's rounding: a lossy profile right on its validation set and far off on traffic it did not hold."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.features = nn.Linear(8, 16)
        self.lift = nn.Linear(1, 16, bias=False)
        with torch.no_grad():
            for parameter in self.features.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            self.lift.weight.fill_(LIFT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lift = self.lift(x[:, :1].clamp(min=0))
        return (torch.tanh(self.features(x)) + lift) - lift


def off_in_bf16() -> nn.Module:
    """The factory the config names."""
    return OffInBf16().eval()
