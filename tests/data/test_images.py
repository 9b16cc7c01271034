"""Image folders: read lazily, checked against the schema's classes and shape, inventoried."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import fedsec.tasks
from fedsec.agent.cli import agent
from fedsec.agent.local_data import check_record, labels
from fedsec.data.images import ImageFolder, image_inventory
from fedsec.errors import ConfigError, TaskMismatch
from fedsec.task import DataSource, Task, TaskData, TaskSchema, TrainingParams

CLASSES = ("cat", "dog", "owl")
SHAPE = (3, 8, 8)


def _write(root: Path, counts: dict[str, int], size: tuple[int, int] = (8, 8)) -> None:
    rng = np.random.default_rng(0)
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels, "RGB").save(root / name / f"{i}.png")


def test_items_are_read_lazily_in_the_schemas_shape(tmp_path: Path) -> None:
    _write(tmp_path, {"cat": 2, "owl": 3})
    Image.new("L", (16, 12), 255).save(tmp_path / "owl" / "grey.png")  # resized, to RGB
    (tmp_path / "owl" / "notes.txt").write_text("not an image")
    data = ImageFolder(tmp_path, CLASSES, SHAPE)
    assert len(data) == 6
    assert data.targets.tolist() == [0, 0, 2, 2, 2, 2]
    x, y = data[2]
    assert x.dtype == torch.float32 and tuple(x.shape) == SHAPE and y.item() == 2
    expected = np.asarray(Image.open(tmp_path / "owl" / "0.png"), np.float32) / 255.0
    assert np.allclose(x.permute(1, 2, 0).numpy(), expected)
    grey, _ = data[data.paths.index(str(tmp_path / "owl" / "grey.png"))]
    assert tuple(grey.shape) == SHAPE and float(grey.min()) == 1.0
    assert labels(data).tolist() == data.targets.tolist()


def test_a_class_folder_outside_the_schema_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, {"cat": 1, "horse": 1})
    with pytest.raises(TaskMismatch, match=r"\['horse'\] that are not among the schema"):
        ImageFolder(tmp_path, CLASSES, SHAPE)
    report = image_inventory(tmp_path, CLASSES, SHAPE)
    assert not report["agrees"] and "horse" in report["refused"]
    assert report["classes"] == {"cat": 1, "dog": 0, "owl": 0}


def test_an_unreadable_image_is_named_in_the_inventory_and_in_training(tmp_path: Path) -> None:
    _write(tmp_path, {"cat": 2, "dog": 1}, size=(10, 6))
    broken = tmp_path / "dog" / "broken.png"
    broken.write_bytes((tmp_path / "dog" / "0.png").read_bytes()[:60])
    report = image_inventory(tmp_path, CLASSES, SHAPE)
    assert report["classes"] == {"cat": 2, "dog": 1, "owl": 0}
    assert report["images"] == 3 and report["sizes"] == {"10x6": 3}
    assert report["modes"] == {"RGB": 3} and report["agrees"]
    assert report["unreadable_count"] == 1
    assert report["unreadable"][0]["file"] == "dog/broken.png"
    data = ImageFolder(tmp_path, CLASSES, SHAPE)
    with pytest.raises(ConfigError, match=r"cannot read image .*broken\.png"):
        data[data.paths.index(str(broken))]


def test_an_image_shape_and_a_missing_folder_are_checked(tmp_path: Path) -> None:
    with pytest.raises(TaskMismatch, match="channels, height, width"):
        ImageFolder(tmp_path, CLASSES, (2, 8, 8))
    with pytest.raises(ConfigError, match="does not exist"):
        ImageFolder(tmp_path / "nowhere", CLASSES, SHAPE)
    with pytest.raises(ConfigError, match="no images"):
        ImageFolder(tmp_path, CLASSES, SHAPE)


def _image_task(shape: tuple[int, ...] = SHAPE, **options: object) -> Task:
    def data(source: DataSource) -> TaskData:
        root = Path(str(source.options["path"]))
        return TaskData(
            train=ImageFolder(root / "train", CLASSES, shape),
            test=ImageFolder(root / "test", CLASSES, shape),
        )

    return Task(
        name="pets",
        version="1",
        schema=TaskSchema(input_shape=SHAPE, num_classes=3, class_names=CLASSES),
        defaults=TrainingParams(lr=0.1, batch_size=4, local_epochs=1),
        model=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 3)),
        data=data,
        options=options,
    )


def test_the_first_record_must_have_the_schemas_input_shape(tmp_path: Path) -> None:
    for split in ("train", "test"):
        _write(tmp_path / split, {"cat": 1, "dog": 1})
    check_record(_image_task(), _image_task(path=str(tmp_path)).datasets().train)
    wrong = _image_task((1, 8, 8), path=str(tmp_path))
    with pytest.raises(TaskMismatch, match=r"shape \(1, 8, 8\); the schema says float32"):
        check_record(wrong, wrong.datasets().train)


def test_agent_inventory_shows_each_split_of_an_image_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "images" / "train", {"cat": 3, "dog": 2})
    _write(tmp_path / "images" / "test", {"owl": 1})
    monkeypatch.setattr(fedsec.tasks, "get_task", lambda name, **options: _image_task(**options))
    config = tmp_path / "agent.toml"
    config.write_text(
        '[agent]\nid = "clinic"\naggregator_url = "http://127.0.0.1:9"\n'
        f'aggregator_public_key = "{"0" * 64}"\nstate_dir = "state"\n'
        f'[data]\ntask = "pets"\ntask_options = {{ path = "{tmp_path / "images"}" }}\n'
    )
    result = CliRunner().invoke(agent, ["inventory", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "train: 5 readable images, 0 unreadable; each becomes 3x8x8" in result.output
    assert "per class: {'cat': 3, 'dog': 2, 'owl': 0}" in result.output
    assert "per class: {'cat': 0, 'dog': 0, 'owl': 1}" in result.output
