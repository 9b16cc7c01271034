"""``fedsec bench member-memory``: a member's peak memory does not grow with its data.

An image folder of ``--records`` PNG files (32x32 RGB, 10 classes) and one of ten times
as many are written (not timed); on each, a fresh child process does a member's work on
its data: it lists the folder (:class:`fedsec.data.images.ImageFolder`), inventories it
(:func:`fedsec.data.images.image_inventory`) and trains one epoch of DP-SGD on it
(:func:`fedsec.learning.training.train_dataset`, Poisson sampling, DataLoader workers).
Its peak RSS (VmHWM) and its worker processes' largest peak are reported;
``growth`` is the peak at 10x the records over the peak at 1x, minus 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from fedsec.bench.common import with_environment

CLASSES = tuple(str(i) for i in range(10))
SHAPE = (3, 32, 32)

_CHILD = """
import json, resource, sys, time
import torch
from torch import nn
from fedsec.data.images import ImageFolder, image_inventory
from fedsec.learning.training import DPParams, TrainingParams, train_dataset

root, classes = sys.argv[1], tuple(sys.argv[2].split(","))
shape = (3, 32, 32)
started = time.perf_counter()
data = ImageFolder(root, classes, shape)
inventory = image_inventory(root, classes, shape)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, len(classes))
)
params = TrainingParams(lr=0.05, batch_size=64, local_epochs=1)
result = train_dataset(model, data, params, DPParams(1.0, 1.0, 1e-5), "cpu", seed=1)
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({
    "records": len(data),
    "images": inventory["images"],
    "steps": result.steps,
    "seconds": time.perf_counter() - started,
    "peak_rss_mb": int(hwm[0].split()[1]) / 1024,
    "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
}))
"""


def write_folder(root: Path, records: int, seed: int = 0) -> None:
    """``records`` random 32x32 RGB PNG files, spread evenly over the 10 class folders."""
    from PIL import Image

    rng = np.random.default_rng(seed)  # test images only
    for name in CLASSES:
        (root / name).mkdir(parents=True, exist_ok=True)
    for i in range(records):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").save(root / CLASSES[i % len(CLASSES)] / f"{i:07d}.png")


def _member(root: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), ",".join(CLASSES)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@click.command("member-memory")
@click.option("--records", default=2_000, show_default=True, help="images of the small folder")
@click.option("--factor", default=10, show_default=True, help="the large folder holds this x")
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_member_memory(records: int, factor: int, as_json: bool) -> None:
    """A member's peak RSS on an image folder and on one `factor` times larger."""
    with tempfile.TemporaryDirectory(prefix="fedsec-member-memory-") as tmp:
        runs = []
        for n in (records, records * factor):
            root = Path(tmp) / str(n)
            started = time.perf_counter()
            write_folder(root, n)
            written = time.perf_counter() - started
            run = _member(root)
            run["write_s"] = round(written, 1)
            runs.append(run)
        small, large = runs
        result = {
            "bench": "member-memory",
            "records": [small["records"], large["records"]],
            "steps": [small["steps"], large["steps"]],
            "member_s": [round(small["seconds"], 1), round(large["seconds"], 1)],
            "member_peak_rss_mb": [round(small["peak_rss_mb"], 1), round(large["peak_rss_mb"], 1)],
            "worker_peak_rss_mb": [
                round(small["worker_peak_rss_mb"], 1),
                round(large["worker_peak_rss_mb"], 1),
            ],
            "growth": round(large["peak_rss_mb"] / small["peak_rss_mb"] - 1, 4),
            "worker_growth": round(
                large["worker_peak_rss_mb"] / small["worker_peak_rss_mb"] - 1, 4
            ),
        }
        click.echo(json.dumps(with_environment(result)))
