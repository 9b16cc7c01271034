"""Image folders: ``root/<class>/<file>`` read lazily as a torch dataset, and their inventory.

An image folder is the layout hospitals' and labs' image exports have: one sub-folder per
class, named as the task's ``class_names``. :class:`ImageFolder` lists the files once
(paths and labels: a few dozen bytes per image) and decodes an image only when the
training loop asks for it, so a member's memory does not grow with its folder.

The schema agreement covers an image folder as it covers a table: every class folder
must be one of the schema's classes (an extra folder's images would have no class
index), and every image becomes the schema's input shape (channels, height, width).
A member may lack a class; the inventory shows it with a count of 0.

The inventory (:func:`image_inventory`) stays with the owner, like a table's data map:
it names files. It gives the count per class, the image sizes and modes found, and each
unreadable file with the reason.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from fedsec.data.limits import IMAGE_SIZES_SHOWN, UNREADABLE_SHOWN
from fedsec.errors import ConfigError, TaskMismatch

#: File name endings read as images (lower case); other files in a class folder are
#: ignored, as exports put notes and thumbnails' indexes beside the images.
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})

#: The PIL mode each channel count of the input shape is read as.
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def _mode(input_shape: Sequence[int]) -> str:
    """PIL mode for an input shape ``(channels, height, width)``.

    Raises:
        TaskMismatch: the shape is not 3-d or has 2 or more than 4 channels.
    """
    if len(input_shape) != 3 or input_shape[0] not in _MODES:
        raise TaskMismatch(
            f"an image task's input shape must be (channels, height, width) with 1, 3 or 4 "
            f"channels, got {tuple(input_shape)}"
        )
    return _MODES[input_shape[0]]


def class_folders(root: Path, classes: Sequence[str]) -> list[str]:
    """The class folders under ``root``, checked against the schema's ``classes``.

    Raises:
        ConfigError: ``root`` is not a folder.
        TaskMismatch: a folder is not one of ``classes`` (named, with the classes).
    """
    if not root.is_dir():
        raise ConfigError(f"image folder {root} does not exist or is not a folder")
    found = sorted(p.name for p in root.iterdir() if p.is_dir())
    extra = [name for name in found if name not in classes]
    if extra:
        raise TaskMismatch(
            f"image folder {root} has class folders {extra} that are not among the "
            f"schema's classes {list(classes)}; rename or remove them"
        )
    return found


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


class ImageFolder(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``root/<class>/<image>`` as ``(float32 tensor of input_shape in [0, 1], int64 class)``.

    Class index i is ``classes[i]``. Images of another size are resized (bilinear) to
    the input shape's height and width, and converted to its channel count.

    Args:
        root: the folder holding one sub-folder per class.
        classes: the schema's class names, in index order.
        input_shape: ``(channels, height, width)`` of every item.

    Raises:
        ConfigError: ``root`` is not a folder, or holds no image.
        TaskMismatch: a class folder is not one of ``classes``, or the shape is not an
            image shape.
    """

    def __init__(self, root: Path | str, classes: Sequence[str], input_shape: Sequence[int]):
        self.root = Path(root)
        self.mode = _mode(input_shape)
        self.size = (int(input_shape[2]), int(input_shape[1]))  # PIL: (width, height)
        index = {name: i for i, name in enumerate(classes)}
        paths: list[str] = []
        labels: list[int] = []
        for name in class_folders(self.root, classes):
            files = _image_files(self.root / name)
            paths.extend(str(p) for p in files)
            labels.extend([index[name]] * len(files))
        if not paths:
            raise ConfigError(f"no images under {self.root}/<class>/")
        self.paths = paths
        #: every item's class index, without decoding an image (partitioning, counts)
        self.targets = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``i``-th image and its class.

        Raises:
            ConfigError: the file cannot be read as an image (naming it).
        """
        path = self.paths[i]
        try:
            with Image.open(path) as opened:
                image = opened.convert(self.mode)
            if image.size != self.size:
                image = image.resize(self.size, Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32)
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise ConfigError(f"cannot read image {path}: {exc}") from exc
        pixels = pixels.reshape(self.size[1], self.size[0], -1) / np.float32(255.0)
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), torch.tensor(
            int(self.targets[i])
        )


def image_inventory(
    root: Path | str, classes: Sequence[str], input_shape: Sequence[int]
) -> dict[str, Any]:
    """The inventory of an image folder as plain JSON values, in one pass over its files.

    Each image is decoded once (a truncated file is found only by decoding it), one at a
    time. ``agrees`` says whether the folder meets the schema: no extra class folder
    and at least one readable image.

    Returns:
        ``root``, ``classes`` (count per schema class, 0 where the folder lacks it),
        ``images``, ``sizes`` (``"WxH": count``, the most frequent first), ``modes``,
        ``unreadable`` (``{"file", "reason"}``, the first :data:`UNREADABLE_SHOWN`),
        ``unreadable_count``, ``input_shape``, ``agrees``, ``refused`` (the schema's
        reason when it does not agree), ``seconds``.

    Raises:
        ConfigError: ``root`` is not a folder.
        TaskMismatch: ``input_shape`` is not an image shape.
    """
    started = time.perf_counter()
    base = Path(root)
    _mode(input_shape)
    if not base.is_dir():
        raise ConfigError(f"image folder {base} does not exist or is not a folder")
    counts = dict.fromkeys(classes, 0)
    sizes: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    unreadable: list[dict[str, str]] = []
    unreadable_count = 0
    refused = ""
    try:
        folders = class_folders(base, classes)
    except TaskMismatch as exc:
        refused = exc.detail
        folders = [p.name for p in sorted(base.iterdir()) if p.is_dir()]
    for name in folders:
        for path in _image_files(base / name):
            try:
                with Image.open(path) as image:
                    image.load()
                    sizes[f"{image.width}x{image.height}"] += 1
                    modes[image.mode] += 1
            except (OSError, UnidentifiedImageError, ValueError) as exc:
                unreadable_count += 1
                if len(unreadable) < UNREADABLE_SHOWN:
                    unreadable.append({"file": str(path.relative_to(base)), "reason": str(exc)})
                continue
            if name in counts:
                counts[name] += 1
    images = sum(counts.values())
    if not refused and images == 0:
        refused = f"no readable images under {base}/<class>/"
    return {
        "root": str(base),
        "classes": counts,
        "images": images,
        "sizes": dict(sizes.most_common(IMAGE_SIZES_SHOWN)),
        "modes": dict(modes.most_common()),
        "unreadable": unreadable,
        "unreadable_count": unreadable_count,
        "input_shape": list(input_shape),
        "agrees": not refused,
        "refused": refused,
        "seconds": round(time.perf_counter() - started, 3),
    }


def render_image_inventory(inventory: dict[str, Any]) -> str:
    """The inventory of an image folder for a terminal."""
    lines = [
        f"image folder {inventory['root']}: {inventory['images']} readable images, "
        f"{inventory['unreadable_count']} unreadable; each becomes "
        f"{'x'.join(map(str, inventory['input_shape']))}"
    ]
    lines.append(f"  per class: {inventory['classes']}")
    lines.append(f"  sizes: {inventory['sizes']}  modes: {inventory['modes']}")
    for entry in inventory["unreadable"]:
        lines.append(f"  ! unreadable {entry['file']}: {entry['reason']}")
    if inventory["refused"]:
        lines.append(f"  ! does not meet the schema: {inventory['refused']}")
    return "\n".join(lines) + "\n"
