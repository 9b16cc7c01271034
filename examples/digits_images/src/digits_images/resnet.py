"""ResNet-18 as torchvision builds it, with GroupNorm, declared here.

``resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(32, c))`` from
torchvision, layer for layer and name for name (``conv1``, ``bn1``, ``layer1.0.conv1``,
``layer2.0.downsample.0``, ``fc``, ...), so a torchvision state dict loads into it and
this one into torchvision's. Declared rather than imported because torchvision is not a
fedsec dependency (and its wheels are built against one torch build each).

The ImageNet stem (7x7 stride-2 convolution, 3x3 stride-2 max-pool) is kept as is: at
32x32 input the feature maps are 16, 8, 8, 4, 2 and 1 pixels wide, so a step costs a
small fraction of a CIFAR-style ResNet-18's (3x3 stem, no pool) on the same images.
"""

from __future__ import annotations

import torch
from torch import nn

#: GroupNorm's group count, torchvision's customary choice with ``norm_layer``; every
#: width here (64..512) divides by it. DP-SGD cannot train BatchNorm: its statistics mix
#: the records of a batch, so one record's gradient depends on the others.
GROUPS = 32
#: Basic blocks per stage and the stages' widths: ResNet-18.
LAYERS = (2, 2, 2, 2)
WIDTHS = (64, 128, 256, 512)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels)


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convolutions, each normalised, and the
    input (through ``downsample`` where the shape changes) added before the last ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _norm(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _norm(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        result: torch.Tensor = self.relu(out + identity)
        return result


def _stage(cin: int, cout: int, blocks: int, stride: int) -> nn.Sequential:
    """One stage: a block that changes the width or the stride, then blocks that keep it."""
    rest = [BasicBlock(cout, cout, 1) for _ in range(blocks - 1)]
    return nn.Sequential(BasicBlock(cin, cout, stride), *rest)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` with ``norm_layer=GroupNorm(32, c)``: 11,181,642
    parameters for 10 classes, the same names and shapes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, WIDTHS[0], 7, 2, 3, bias=False)
        self.bn1 = _norm(WIDTHS[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = _stage(WIDTHS[0], WIDTHS[0], LAYERS[0], 1)
        self.layer2 = _stage(WIDTHS[0], WIDTHS[1], LAYERS[1], 2)
        self.layer3 = _stage(WIDTHS[1], WIDTHS[2], LAYERS[2], 2)
        self.layer4 = _stage(WIDTHS[2], WIDTHS[3], LAYERS[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(WIDTHS[-1], num_classes)
        # torchvision's initialisation: Kaiming-normal convolutions (fan-out, ReLU), norm
        # layers at weight 1 and bias 0 (GroupNorm's own default), nn.Linear's default fc
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        logits: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return logits
