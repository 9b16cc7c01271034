"""The example installs, is found by its entry point, reads its folder and learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from digits_images import accuracy
from digits_images.make_folder import make_folder
from PIL import Image

from fedsec.learning.training import DPParams, train_dataset
from fedsec.simulation import SimulationSpec
from fedsec.task import TrainingParams, load_task
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


def _torchvision_resnet18_parameters() -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of torchvision's ``resnet18(num_classes=10, norm_layer=lambda c:
    nn.GroupNorm(32, c))``, in its registration order, written from its structure:
    stem, four stages of two basic blocks (64/128/256/512 channels; a 1x1 downsample
    where a stage starts at stride 2), fc."""
    expected = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    cin = 64
    for stage, width in enumerate((64, 128, 256, 512), start=1):
        for block in (0, 1):
            prefix = f"layer{stage}.{block}"
            inputs = cin if block == 0 else width
            expected += [
                (f"{prefix}.conv1.weight", (width, inputs, 3, 3)),
                (f"{prefix}.bn1.weight", (width,)),
                (f"{prefix}.bn1.bias", (width,)),
                (f"{prefix}.conv2.weight", (width, width, 3, 3)),
                (f"{prefix}.bn2.weight", (width,)),
                (f"{prefix}.bn2.bias", (width,)),
            ]
            if block == 0 and stage > 1:
                expected += [
                    (f"{prefix}.downsample.0.weight", (width, cin, 1, 1)),
                    (f"{prefix}.downsample.1.weight", (width,)),
                    (f"{prefix}.downsample.1.bias", (width,)),
                ]
        cin = width
    return [*expected, ("fc.weight", (10, 512)), ("fc.bias", (10,))]


def test_resnet18_is_torchvisions_layer_for_layer_and_trains_under_dp() -> None:
    task = load_task("digits_images_resnet18", path="unused")
    model = task.build_model(0)
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert params == _torchvision_resnet18_parameters()
    assert sum(p.numel() for p in model.parameters()) == 11_181_642
    assert list(model.state_dict()) == [name for name, _ in params]  # no buffers
    # a state dict under torchvision's names and shapes loads strictly
    model.load_state_dict({name: 0.01 * torch.randn(shape) for name, shape in params})
    check_dp_compatible(task.name, model)
    # One DP-SGD step through fedsec's loop (Opacus' hooks refuse an in-place ReLU on a
    # hooked layer's output, which torchvision's own resnet18 has).
    records = torch.utils.data.TensorDataset(torch.rand(2, 3, 32, 32), torch.arange(2))
    before = model.fc.weight.detach().clone()
    result = train_dataset(
        model, records, TrainingParams(lr=0.1, batch_size=2, local_epochs=1),
        DPParams(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5), "cpu", seed=0,
        task=task, workers=0,
    )  # fmt: skip
    assert result.steps == 1 and not torch.equal(model.fc.weight, before)


def test_distributed_federation_is_the_central_dp_sgd_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accuracy bench's distributed-DP federation takes the central run's steps: one
    round per step, its sampling rate, learning rate and (so) its noise multiplier."""
    for split, per_class in (("train", 7), ("test", 1)):
        for digit in range(10):
            folder = tmp_path / split / str(digit)
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (32, 32)).save(folder / f"{i}.png")
    specs: list[SimulationSpec] = []

    async def simulate(spec: SimulationSpec, workdir: Path) -> dict[str, object]:
        assert workdir.is_dir() and not str(workdir).startswith("/dev/shm")
        specs.append(spec)
        raise _Stop

    monkeypatch.setattr(accuracy, "run_simulation", simulate)
    args = ["--epochs", "3", "--batch-size", "16", "--lr", "0.2", "--folder", str(tmp_path)]
    with pytest.raises(_Stop):
        accuracy.main([*args, "--only", "federated"])
    (spec,) = specs
    rate, steps = 1 / 5, 15  # 70 records in batches of 16: 5 batches an epoch, 3 epochs
    assert (spec.dp_mode, spec.dp_unit, spec.dp_epsilon) == ("distributed", "record", 8.0)
    assert (spec.dp_sample_rate, spec.rounds) == (rate, steps)
    assert (spec.server_optimizer, spec.server_lr, spec.dp_min_survivors) == ("fedavg", 0.2, 1.0)
    # (the simulation sizes σ for `rounds` rounds of one step, the central run for one
    # run of `steps` steps: noise_for_budget composes them alike, so σ is the same)


class _Stop(Exception):
    """Ends a run once its simulation spec is captured."""
