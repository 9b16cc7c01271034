"""The shape of a task's data, which every member of a federation must agree on.

Members compare schemas by fingerprint (sha256 of the canonical JSON), so equal
schemas hash equally on every machine; a mismatch is refused naming the fields that
differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fedsec.errors import TaskMismatch

if TYPE_CHECKING:
    from fedsec.task.definition import Task

#: What a record's target is: one class index (int64, ``()``), ``num_classes`` real
#: values (float32, ``(num_classes,)``: regression) or ``num_classes`` independent 0/1
#: labels (float32, ``(num_classes,)``: multi-label).
Target = Literal["class", "value", "labels"]
TARGETS: tuple[Target, ...] = ("class", "value", "labels")


@dataclass(frozen=True)
class TaskSchema:
    """The shape of a task's data, which every member must agree on.

    ``input_shape`` excludes the batch dimension. ``class_names`` fixes the meaning of
    each class index (index i is ``class_names[i]``); it matters when members derive
    classes from their own files. ``target`` says what ``num_classes`` counts: classes
    (one index per record), regression outputs or labels (see :data:`Target`);
    ``class_names`` then names each output or label.

    Raises:
        TaskMismatch: ``target`` is not one of :data:`TARGETS`, or ``num_classes < 1``.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    feature_names: tuple[str, ...] | None = None
    class_names: tuple[str, ...] | None = None
    target: Target = "class"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise TaskMismatch(f"task target '{self.target}' is not one of {list(TARGETS)}")
        if self.num_classes < 1:
            raise TaskMismatch(f"a task needs at least one output, got {self.num_classes}")

    def to_dict(self) -> dict[str, Any]:
        """The schema as plain JSON-compatible values (lists, not tuples).

        ``target`` appears only when it is not ``class``, so a classification schema's
        fingerprint is the one it had before targets were declared.
        """
        fields: dict[str, Any] = {
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "feature_names": None if self.feature_names is None else list(self.feature_names),
            "class_names": None if self.class_names is None else list(self.class_names),
        }
        if self.target != "class":
            fields["target"] = self.target
        return fields

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TaskSchema:
        """Rebuild a schema from :meth:`to_dict` output.

        Raises:
            TaskMismatch: ``raw`` lacks a field or has a field of the wrong type.
        """
        try:
            feature_names = raw["feature_names"]
            class_names = raw["class_names"]
            return cls(
                input_shape=tuple(int(d) for d in raw["input_shape"]),
                num_classes=int(raw["num_classes"]),
                feature_names=None if feature_names is None else tuple(map(str, feature_names)),
                class_names=None if class_names is None else tuple(map(str, class_names)),
                target=raw.get("target", "class"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskMismatch(f"task schema is malformed: {exc!r}") from exc

    def fingerprint(self) -> str:
        """sha256 hex digest of the canonical JSON of the schema.

        Canonical: sorted keys, no whitespace, UTF-8; so equal schemas hash equally on
        every machine and Python version.
        """
        canonical = json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def check_schema(
    expected_fingerprint: str, task: Task, expected_schema: TaskSchema | None = None
) -> None:
    """Refuse a local task whose schema differs from the federation's.

    Args:
        expected_fingerprint: the schema fingerprint the round requires.
        task: the local task.
        expected_schema: the federation's full schema, if known; lets the error name the
            fields that differ instead of only the local schema.

    Raises:
        TaskMismatch: the fingerprints differ; the message names the difference.
    """
    local = task.schema
    local_fp = local.fingerprint()
    if local_fp == expected_fingerprint:
        return
    if expected_schema is not None and expected_schema.fingerprint() == expected_fingerprint:
        diffs = _schema_differences(expected_schema, local)
        raise TaskMismatch(
            f"task '{task.name}' does not match the federation's schema: " + "; ".join(diffs)
        )
    raise TaskMismatch(
        f"task '{task.name}' schema fingerprint {local_fp[:12]} does not match the "
        f"federation's {expected_fingerprint[:12]}; local schema is {_describe(local)}"
    )


def _schema_differences(expected: TaskSchema, local: TaskSchema) -> list[str]:
    diffs: list[str] = []
    if expected.target != local.target:
        diffs.append(f"target expected {expected.target}, local {local.target}")
    if expected.input_shape != local.input_shape:
        diffs.append(f"input_shape expected {expected.input_shape}, local {local.input_shape}")
    if expected.num_classes != local.num_classes:
        diffs.append(f"num_classes expected {expected.num_classes}, local {local.num_classes}")
    for label, want, have in (
        ("feature_names", expected.feature_names, local.feature_names),
        ("class_names", expected.class_names, local.class_names),
    ):
        if want == have:
            continue
        if want is None or have is None:
            diffs.append(f"{label} expected {want}, local {have}")
            continue
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        if missing or extra:
            diffs.append(f"{label} missing locally {missing}, extra locally {extra}")
        else:
            diffs.append(f"{label} in a different order: expected {list(want)}, local {list(have)}")
    return diffs


def _describe(schema: TaskSchema) -> str:
    parts = [f"input_shape={schema.input_shape}", f"num_classes={schema.num_classes}"]
    if schema.target != "class":
        parts.append(f"target={schema.target}")
    if schema.feature_names is not None:
        parts.append(f"{len(schema.feature_names)} named features")
    if schema.class_names is not None:
        parts.append(f"classes={list(schema.class_names)}")
    return ", ".join(parts)
