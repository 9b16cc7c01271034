"""The digest of an installed task distribution, and the pin that carries it."""

from __future__ import annotations

from importlib.metadata import distribution
from pathlib import Path

import pytest

from fedsec.errors import InvalidTask, TaskDigestMismatch
from fedsec.protocol.wire import TaskPin
from fedsec.task.digest import check_pin, distribution_digest, pin_differences, task_pin
from tests.task.conftest import InstallDist

TOY = "from fedsec.tasks.sklearn_tasks import digits_task as task\n"


def _install(install_dist: InstallDist, name: str = "toy-task") -> Path:
    return install_dist(name, "1.0", {"toy": "toy_pkg:task"}, {"toy_pkg": TOY})


def test_pin_names_the_distribution_version_and_digest(install_dist: InstallDist) -> None:
    _install(install_dist)
    pin = task_pin("toy")
    assert (pin.entry_point, pin.distribution, pin.version) == ("toy", "toy-task", "1.0")
    assert pin.digest == distribution_digest(distribution("toy-task"))
    assert len(pin.digest) == 64


def test_a_changed_file_changes_the_digest(install_dist: InstallDist) -> None:
    site = _install(install_dist)
    before = task_pin("toy").digest
    (site / "toy_pkg" / "__init__.py").write_text(TOY + "# changed\n", encoding="utf-8")
    assert task_pin("toy").digest != before


def test_per_install_files_and_bytecode_do_not_change_the_digest(
    install_dist: InstallDist,
) -> None:
    site = _install(install_dist)
    before = task_pin("toy").digest
    info = site / "toy_task-1.0.dist-info"
    extra = ["INSTALLER", "REQUESTED", "direct_url.json", "../../../bin/toy"]
    (info / "INSTALLER").write_text("uv\n", encoding="utf-8")
    (info / "REQUESTED").write_text("", encoding="utf-8")
    (info / "direct_url.json").write_text('{"url": "file:///elsewhere"}', encoding="utf-8")
    (site / "toy_pkg" / "__pycache__").mkdir()
    (site / "toy_pkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    with (info / "RECORD").open("a", encoding="utf-8") as record:
        record.writelines(f"{info.name}/{f},,\n" for f in extra[:3])
        record.write(f"{extra[3]},,\ntoy_pkg/__pycache__/x.cpython-311.pyc,,\n")
    assert task_pin("toy").digest == before


def test_a_missing_file_is_refused(install_dist: InstallDist) -> None:
    site = _install(install_dist)
    (site / "toy_pkg" / "__init__.py").unlink()
    with pytest.raises(InvalidTask, match=r"toy-task 1.0 is incomplete: toy_pkg/__init__.py"):
        distribution_digest(distribution("toy-task"))


def test_pin_differences_name_each_field() -> None:
    pin = TaskPin("xray", "xray-task", "1.0", "a" * 64)
    assert pin_differences(pin, pin) == []
    other = TaskPin("xray", "xray-task", "1.1", "b" * 64)
    assert pin_differences(pin, other) == [
        "version expected '1.0', installed '1.1'",
        f"digest expected '{'a' * 64}', installed '{'b' * 64}'",
    ]
    check_pin(pin, pin, "m1")
    with pytest.raises(TaskDigestMismatch, match=r"m1: .* version expected '1.0', installed '1.1'"):
        check_pin(pin, other, "m1")


def test_bundled_tasks_are_pinned_by_fedsecs_own_files() -> None:
    pin = task_pin("digits")
    assert (pin.distribution, pin.entry_point) == ("fedsec", "digits")
    assert pin.digest == task_pin("mnist1d").digest  # one distribution, one digest
