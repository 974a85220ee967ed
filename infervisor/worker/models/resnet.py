"""ResNet-shaped CNNs built in code, one module per call site (PT2E quantization needs that)."""

from __future__ import annotations

import torch
from torch import nn

from infervisor.worker.models.init import default_init_skipped


class Bottleneck(nn.Module):
    """1x1-3x3-1x1 residual block, each ReLU its own module."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu3 = nn.ReLU()
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.downsample(x))


class BasicBlock(nn.Module):
    """3x3-3x3 residual block of ResNet-18/34."""

    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_ch != width:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.downsample(x))


class ResNet(nn.Module):
    """Stem, four stages, global pool, classifier: the torchvision layout without torchvision."""

    def __init__(self, block: type[Bottleneck] | type[BasicBlock], layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages: list[nn.Module] = []
        in_ch = 64
        for index, (width, count) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            blocks: list[nn.Module] = []
            for b in range(count):
                blocks.append(block(in_ch, width, 2 if b == 0 and index > 0 else 1))
                in_ch = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        # A small last-BN gain keeps random-weight activations bounded through 16 residual adds,
        # so fp32 and optimised profiles can be compared on meaningful, finite logits.
        for module in self.modules():
            if isinstance(module, Bottleneck):
                nn.init.constant_(module.bn3.weight, 0.2)
            elif isinstance(module, BasicBlock):
                nn.init.constant_(module.bn2.weight, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50() -> ResNet:
    """ResNet-50 shape: bottleneck blocks [3, 4, 6, 3], 25.6 M parameters."""
    with default_init_skipped(nn.Conv2d):
        return ResNet(Bottleneck, [3, 4, 6, 3])


def resnet18() -> ResNet:
    """ResNet-18 shape: basic blocks [2, 2, 2, 2], 11.7 M parameters."""
    with default_init_skipped(nn.Conv2d):
        return ResNet(BasicBlock, [2, 2, 2, 2])
