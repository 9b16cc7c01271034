"""The digits_images tasks: a GroupNorm ResNet over an image folder.

Two entry points over the same data: ``digits_images``, a 78k-parameter three-block
ResNet that a federation trains in seconds (the suite's end-to-end test), and
``digits_images_resnet18``, torchvision's ResNet-18 with GroupNorm (11.2M parameters,
:mod:`digits_images.resnet`), the model the accuracy benchmark
(:mod:`digits_images.accuracy`) trains.

The member's folder comes from its task options (``path`` in ``[data] task_options``),
or from ``DIGITS_IMAGES_DIR`` where a tool passes no options (``fedsec simulate``).
Images are read one at a time, when the training loop asks for them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

from digits_images.resnet import ResNet18
from fedsec.errors import ConfigError
from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams

CLASSES = tuple(str(d) for d in range(10))
SIZE = 32


class ImageFolder(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``root/<class>/*.png`` as (3x32x32 float tensor in [0, 1], class index)."""

    def __init__(self, root: Path) -> None:
        self.files = [
            (path, index)
            for index, name in enumerate(CLASSES)
            for path in sorted((root / name).glob("*.png"))
        ]
        if not self.files:
            raise ConfigError(f"no images under {root}/<class>/*.png")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        path, label = self.files[i]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB").resize((SIZE, SIZE)), dtype=np.float32)
        return torch.from_numpy(pixels / 255.0).permute(2, 0, 1), torch.tensor(label)


def data(source: DataSource) -> TaskData:
    """The member's image folder; the folder's own train/test split (``seed`` unused)."""
    root = source.options.get("path") or os.environ.get("DIGITS_IMAGES_DIR")
    if not root:
        raise ConfigError(
            "digits_images needs its image folder: task option 'path' or DIGITS_IMAGES_DIR"
        )
    return TaskData(train=ImageFolder(Path(root) / "train"), test=ImageFolder(Path(root) / "test"))


class Block(nn.Module):
    """A ResNet basic block with GroupNorm (DP-SGD cannot train BatchNorm)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, cout)
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.skip(x))


class SmallResNet(nn.Module):
    """ResNet-style: a stem, three basic blocks (16, 32, 64 channels), pooled, linear."""

    def __init__(self, classes: int = len(CLASSES)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(8, 16))
        self.blocks = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2))
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(torch.relu(self.stem(x)))
        logits: torch.Tensor = self.head(h.mean(dim=(2, 3)))
        return logits


SCHEMA = TaskSchema(input_shape=(3, SIZE, SIZE), num_classes=len(CLASSES), class_names=CLASSES)

task = Task(
    name="digits_images",
    version="1",
    schema=SCHEMA,
    defaults=TrainingParams(lr=0.05, batch_size=32, local_epochs=1, momentum=0.9),
    model=SmallResNet,
    data=data,
)

resnet18_task = Task(
    name="digits_images_resnet18",
    version="1",
    schema=SCHEMA,
    defaults=TrainingParams(lr=0.05, batch_size=32, local_epochs=1, momentum=0.9),
    model=ResNet18,
    data=data,
)
