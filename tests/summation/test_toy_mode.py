"""A fourth summation mode, written here and nowhere else, runs a real round.

The toy mode is plain summation with another stage list: after the uploads a ``unmask``
stage in which nobody sends anything lasts its own window (a settling period, say for a
veto to arrive), then the sum closes.  It is registered into :data:`fedsec.summation.MODES`
under ``none`` (the name a spec and ``federation.toml`` can carry; a new name would add
it to ``wire.SecureSum`` and ``RoundSection.secure_sum``).  The real coordinator forms
the cohort, takes the uploads, keeps the toy's stages and deadlines, resumes after a
restart in the toy's own stage, and closes the round with the exact plain aggregate.
Nothing outside this file changes for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.workspace import Workspace
from fedsec.errors import WrongStage
from fedsec.protocol import wire
from fedsec.protocol.stages import Stage
from fedsec.summation import MODES, SessionInputs
from fedsec.summation.mode import StageWindow, upload_window
from fedsec.summation.plain import PlainMode, PlainSession
from fedsec.summation.session import StageMessage
from tests.support.aggregator import (
    FakeClock,
    Federation,
    expected_params,
    join_request,
    make_federation,
    model_params,
    plain_upload,
    quantized_input,
)

MEMBERS = ("a0", "a1", "a2")
SETTLE_S = 7.0  # the toy's own window for its settling stage
TOY_STAGES: tuple[Stage, ...] = ("masked_input", "unmask")


class SettledSession(PlainSession):
    """A plain sum whose uploads close before a settling stage with no messages."""

    stages = TOY_STAGES

    def __init__(self, spec: wire.RoundSpec, min_agents: int) -> None:
        super().__init__(spec, min_agents)
        self.settling = False

    def receive(self, stage: str, message: StageMessage) -> None:
        if self.settling:
            raise WrongStage(f"round {self.spec.round} is settling; the uploads closed")
        super().receive(stage, message)

    def complete(self, stage: str) -> bool:
        return stage == "masked_input" and super().complete(stage)  # unmask: its deadline

    def close(self, stage: str) -> None:
        if stage != "masked_input":
            raise ValueError(f"stage {stage!r} is not closed by close()")
        self.settling = True


@dataclass(frozen=True)
class SettledMode(PlainMode):
    stages: tuple[Stage, ...] = TOY_STAGES
    windows: Mapping[str, StageWindow] = field(
        default_factory=lambda: {"masked_input": upload_window, "unmask": lambda r, b: SETTLE_S}
    )

    def _open(self, spec: wire.RoundSpec, inputs: SessionInputs) -> SettledSession:
        return SettledSession(spec, inputs.min_agents)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[SettledMode]:
    mode = SettledMode()
    monkeypatch.setitem(MODES, "none", mode)
    yield mode


def _federation(root: Path) -> Federation:
    return make_federation(
        root, agents=MEMBERS, round={"secure_sum": "none", "min_agents": 2, "rounds": 1}
    )


def test_a_toy_mode_registered_in_a_test_runs_a_real_round(
    tmp_path: Path, toy: SettledMode
) -> None:
    clock = FakeClock()
    fed = _federation(tmp_path / "ws")
    coord = Coordinator(fed.ws, clock=clock)
    for m in MEMBERS:
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()
    spec = coord.live.spec
    assert spec is not None and coord.live.stage == "masked_input"
    assert isinstance(coord.live.summation, SettledSession)
    for m in MEMBERS:
        coord.masked_input(m, 1, 0, *plain_upload(m, spec, fed.identities))
    # every upload in: the toy's next stage, not the end of the round
    assert coord.live.stage == "unmask" and coord.has_stage("unmask")
    assert coord.deadline() == clock.now + SETTLE_S

    # a restart in the toy's own stage rebuilds it from the stored uploads
    fed.ws.close()
    fed = Federation(Workspace.open(fed.root), fed.identities)
    coord = Coordinator(fed.ws, clock=clock)
    assert coord.live.stage == "unmask" and isinstance(coord.live.summation, SettledSession)
    assert coord.live.summation.settling and coord.live.plain_members == list(MEMBERS)

    clock.advance(SETTLE_S - 0.5)
    coord.tick()
    assert coord.live.stage == "unmask"  # its window has not passed
    clock.advance(1.0)
    coord.tick()
    assert coord.finished and coord.live.stage == "closed"
    quantized = [quantized_input(m, spec) for m in MEMBERS]
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    np.testing.assert_allclose(new, expected_params(old, quantized, spec), rtol=0, atol=1e-6)
