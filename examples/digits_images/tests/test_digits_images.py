"""The example installs, is found by its entry point, reads its folder and learns."""

from __future__ import annotations

from pathlib import Path

import torch
from digits_images.make_folder import make_folder

from fedsec.task import load_task
from fedsec.task.dp import check_dp_compatible


def test_folder_task_reads_images_lazily_and_trains(tmp_path: Path) -> None:
    counts = make_folder(tmp_path)
    assert counts == {"train": 1438, "test": 359}
    task = load_task("digits_images", path=str(tmp_path))
    data = task.datasets()
    x, y = data.train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= int(y) < 10
    model = task.build_model(0)
    check_dp_compatible(task.name, model)
    # One fixed batch mixing the classes; the model must fit it (it learns at all).
    shuffled = torch.utils.data.DataLoader(
        data.train, batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    batch = next(iter(shuffled))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with torch.no_grad():
        first = float(task.batch_loss(model, batch))
    for _ in range(30):
        optimizer.zero_grad()
        task.batch_loss(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        assert float(task.batch_loss(model, batch)) < 0.95 * first  # 0.89 in one run
