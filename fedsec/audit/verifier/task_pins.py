"""The task package each round spec pins, and, when asked, whether it is the one
installed here.

The aggregator pins the package it runs in every spec it signs; members compare that
pin with their own installation before training. The auditor lists the pins the log
holds (a change between rounds is an operator's upgrade, visible here) and, with
``fedsec audit verify --check-task-pin``, refuses a spec whose pin is not the one it
computes from its own installation: the code the federation ran is the code the
auditor reviewed. Not by default: verifying the log's integrity needs no task package,
and an auditor without the federation's wheel installed (or with it installed another
way, which digests differently) still checks every signature and sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedsec.audit.verifier import EntryProblem
from fedsec.protocol import wire
from fedsec.task.digest import pin_differences

#: the pin of the task named, from this machine's installation
LocalPin = Callable[[str], wire.TaskPin]


class TaskPins:
    """Every distinct pin of the log, with the rounds that pinned it.

    Args:
        local: when given, each spec's pin must equal ``local(spec.task)``.
    """

    def __init__(self, local: LocalPin | None = None) -> None:
        self._local = local
        self._rounds: dict[wire.TaskPin | None, list[int]] = {}

    def on_round_spec(self, spec: wire.RoundSpec) -> None:
        """Record the spec's pin; compare it with the local installation when asked.

        Raises:
            EntryProblem: (with a local installation to compare with) the spec pins no
                package, or another one (each differing field named).
            UnknownTask, InvalidTask: the task is not installed here, or its files
                cannot be read.
        """
        rounds = self._rounds.setdefault(spec.task_pin, [])
        if not rounds or rounds[-1] != spec.round:
            rounds.append(spec.round)
        if self._local is None:
            return
        where = f"round {spec.round} attempt {spec.attempt}"
        if spec.task_pin is None:
            raise EntryProblem(
                f"{where}: the spec pins no task package, so the code the members ran cannot "
                "be compared with the one installed here"
            )
        diffs = pin_differences(spec.task_pin, self._local(spec.task))
        if diffs:
            raise EntryProblem(
                f"{where} pins a task package other than the one installed here: "
                + "; ".join(diffs)
            )

    def as_list(self) -> list[dict[str, Any]]:
        """One row per distinct pin (``pin`` None: specs signed before pinning)."""
        return [
            {
                "pin": None
                if pin is None
                else {
                    "entry_point": pin.entry_point,
                    "distribution": pin.distribution,
                    "version": pin.version,
                    "digest": pin.digest,
                },
                "rounds": rounds,
            }
            for pin, rounds in self._rounds.items()
        ]
