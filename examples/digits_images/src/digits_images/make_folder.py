"""Write scikit-learn's bundled digits as an image folder: ``OUT/{train,test}/<digit>/*.png``.

Each 8x8 image (grey levels 0..16) is scaled to 0..255, upscaled to 32x32 (bilinear)
and stored as RGB, the layout a hospital's or a lab's image export has. Nothing is
downloaded. 20 % of each class is held out as ``test``, chosen by a fixed seed.

    python -m digits_images.make_folder OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

SIZE = 32
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def make_folder(out: Path) -> dict[str, int]:
    """Write the folder; returns the number of images written per split."""
    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float64) * (255.0 / 16.0)
    labels = np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(SPLIT_SEED)
    counts = {"train": 0, "test": 0}
    for digit in range(10):
        index = rng.permutation(np.flatnonzero(labels == digit))
        n_test = round(len(index) * TEST_FRACTION)
        for split, part in (("test", index[:n_test]), ("train", index[n_test:])):
            folder = out / split / str(digit)
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                grey = Image.fromarray(images[i].round().astype(np.uint8), mode="L")
                grey.resize((SIZE, SIZE), Image.Resampling.BILINEAR).convert("RGB").save(
                    folder / f"{i:04d}.png"
                )
            counts[split] += len(part)
    return counts


if __name__ == "__main__":
    written = make_folder(Path(sys.argv[1]))
    print(f"wrote {written['train']} train and {written['test']} test images to {sys.argv[1]}")
