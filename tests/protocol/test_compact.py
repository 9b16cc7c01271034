"""The compact (msgpack) uploads decode to exactly the JSON body they stand for, are
about half its size, and refuse what the JSON form would refuse, before any state."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedsec.errors import PayloadError, PayloadTooLarge
from fedsec.protocol import compact, wire

LIMIT = 1 << 20
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
SHARES = st.binary(min_size=1, max_size=120).map(bytes.hex)


def _report() -> wire.PrivacyReport:
    return wire.PrivacyReport(
        federation_id="f",
        round=3,
        attempt=0,
        member="agent-1",
        dataset_id="d",
        epsilon=1.5,
        delta=1e-5,
        noise_multiplier=1.1,
        sample_rate=0.25,
        steps=8,
        samples=80,
        signature="ab" * 64,
    )


def _advertise() -> wire.AdvertiseKeysBody:
    return wire.AdvertiseKeysBody(os.urandom(32).hex(), os.urandom(32).hex(), os.urandom(64).hex())


def _shares(n: int = 21) -> wire.ShareKeysBody:
    return wire.ShareKeysBody(
        [wire.OutgoingShare(f"agent-{i}", os.urandom(110).hex()) for i in range(n)], _report()
    )


def _round_trip(body: compact.Body) -> compact.Body:
    kind: Any = type(body)
    decoded: compact.Body = compact.to_body(
        compact.encode(body), kind, max_bytes=LIMIT, what="upload"
    )
    return decoded


def test_each_upload_decodes_to_the_body_it_stands_for() -> None:
    for body in (
        _advertise(),
        _shares(),
        wire.ShareKeysBody([wire.OutgoingShare("a", "00ff")]),  # without a report
        wire.UnmaskResponseBody({"a": "0102", "b": "03"}, {"c": "ff" * 35}),
    ):
        decoded = _round_trip(body)
        assert decoded == body
        # what the aggregator stores and archives: the same bytes as for a JSON upload
        assert wire.encode(decoded) == wire.encode(body)


@given(
    seeds=st.dictionaries(NAMES, SHARES, max_size=30),
    keys=st.dictionaries(NAMES, SHARES, max_size=30),
)
def test_unmask_answers_round_trip(seeds: dict[str, str], keys: dict[str, str]) -> None:
    body = wire.UnmaskResponseBody(seeds, keys)
    assert _round_trip(body) == body


@given(st.lists(st.tuples(NAMES, SHARES), max_size=30))
def test_share_lists_round_trip_in_order(pairs: list[tuple[str, str]]) -> None:
    body = wire.ShareKeysBody([wire.OutgoingShare(m, c) for m, c in pairs])
    assert _round_trip(body) == body


def test_compact_uploads_are_about_half_the_json() -> None:
    for body in (_advertise(), _shares()):
        assert len(compact.encode(body)) < 0.6 * len(wire.encode(body))


@pytest.mark.parametrize(
    ("kind", "value", "match"),
    [
        (wire.AdvertiseKeysBody, [b"k" * 31, b"k" * 32, b"s" * 64], "invalid"),
        (wire.AdvertiseKeysBody, [b"k" * 32, b"k" * 32, b"s" * 65], "invalid"),
        (wire.AdvertiseKeysBody, ["ab" * 32, b"k" * 32, b"s" * 64], "invalid"),
        (wire.AdvertiseKeysBody, {"enc_public": b"k" * 32}, "invalid"),
        (wire.ShareKeysBody, [[["a", b"x"]], {"unknown": 1}], "invalid"),
        (wire.ShareKeysBody, [[["", b"x"]]], "invalid"),
        (wire.UnmaskResponseBody, [[["a", b"x"], ["a", b"y"]], []], "names 'a' twice"),
        (wire.UnmaskResponseBody, [[], [["b", b"x"], ["b", b"x"]]], "names 'b' twice"),
    ],
)
def test_malformed_uploads_are_refused(kind: type[compact.B], value: object, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        compact.to_body(msgspec.msgpack.encode(value), kind, max_bytes=LIMIT, what="upload")


def test_json_sent_as_msgpack_and_oversized_uploads_are_refused() -> None:
    body = _advertise()
    with pytest.raises(PayloadError, match="Expected `array`, got `int`"):
        compact.to_body(wire.encode(body), wire.AdvertiseKeysBody, max_bytes=LIMIT, what="upload")
    raw = compact.encode(body)
    with pytest.raises(PayloadTooLarge):
        compact.to_body(raw, wire.AdvertiseKeysBody, max_bytes=len(raw) - 1, what="upload")
    with pytest.raises(PayloadError, match="no compact"):
        compact.to_body(raw, wire.JoinRequest, max_bytes=LIMIT, what="upload")  # type: ignore[type-var]
