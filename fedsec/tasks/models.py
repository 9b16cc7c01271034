"""Model architectures of the bundled tasks.

Every model here is Opacus-compatible: only Linear, Conv and activation layers, no
BatchNorm (per-sample gradients are undefined when samples are mixed by batch
statistics), no buffers, so a model's whole state is its trainable parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class TabularMLP(nn.Module):
    """Two-layer perceptron for standardized tabular features."""

    def __init__(self, n_features: int, n_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(n_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # type: ignore[no-any-return]


class DigitsCNN(nn.Module):
    """Small CNN for 1x8x8 digit images: two conv blocks then a linear classifier."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        self.classifier = nn.Linear(32 * 2 * 2, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))  # type: ignore[no-any-return]


class Mnist1dCNN(nn.Module):
    """The convolutional baseline of the MNIST-1D paper (Greydanus & Kobak, 2020/2024).

    Three stride-2 Conv1d layers of 25 channels with ReLU, then a linear layer on the
    flattened 25x5 features; about 5k parameters. Input is (batch, 1, 40).
    """

    def __init__(self, n_classes: int = 10, channels: int = 25, length: int = 40) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, kernel_size=5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1)
        out_len = length
        for kernel in (5, 3, 3):
            out_len = (out_len + 2 - kernel) // 2 + 1
        self.linear = nn.Linear(channels * out_len, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))
        h = torch.relu(self.conv3(h))
        return self.linear(h.flatten(1))  # type: ignore[no-any-return]
