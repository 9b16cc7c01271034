"""The star seam carries every stage message the agent's actions name, each to the
aggregator client call of its stage."""

from __future__ import annotations

import asyncio
import typing
from typing import Any

from fedsec.agent import actions as act
from fedsec.agent.seam import StarSeam
from fedsec.protocol.wire import (
    Accepted,
    AdvertiseKeysBody,
    CommitBody,
    ConsistencyBody,
    ContributionStatement,
    ShareKeysBody,
    UnmaskResponseBody,
)

UPLOADS = (
    AdvertiseKeysBody("aa", "bb", "cc"),
    ShareKeysBody([]),
    ConsistencyBody("dd"),
    CommitBody("ee", "ff"),
    UnmaskResponseBody({}, {}),
)


class RecordingClient:
    """Stands in for AggregatorClient: records which call each message reached."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return Accepted(True) if name != "masked_input" else ("receipt", None)

        return call


def test_every_stage_upload_and_answer_reaches_its_client_call() -> None:
    client = RecordingClient()
    seam = StarSeam(client)  # type: ignore[arg-type]
    assert {type(body) for body in UPLOADS} == set(typing.get_args(act.UploadBody))
    answers = typing.get_args(act.StageAnswer)

    async def run() -> None:
        for body in UPLOADS:
            await seam.send(3, 1, body, 2.0)
        for kind in answers:
            await seam.answer(3, 1, kind, 2.0)
        statement = ContributionStatement("fed", 3, 1, "alice", "00" * 32, "11" * 32)
        assert await seam.contribute(3, 1, b"v", statement, 0.0) == ("receipt", None)

    asyncio.run(run())
    names = [name for name, _ in client.calls]
    assert names == [
        "advertise",
        "post_shares",
        "consistency",
        "commit",
        "unmask",
        "keys",
        "get_shares",
        "get_unmask",
        "get_consistency",
        "get_commit",
        "masked_input",
    ]
    assert all(args[:2] == (3, 1) for _, args in client.calls)


def test_every_stage_action_names_a_message_the_seam_carries() -> None:
    fetched = {cls.answer.kind for cls in act.StageFetch.__subclasses__()}
    assert fetched == set(typing.get_args(act.StageAnswer))
    sent = {typing.get_type_hints(cls)["body"] for cls in act.StageUpload.__subclasses__()}
    assert sent == set(typing.get_args(act.UploadBody))
