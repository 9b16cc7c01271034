"""The key list's JSON, encoded once per list and spliced into every member's answer."""

from __future__ import annotations

import msgspec

from fedsec.aggregator.http import handlers
from fedsec.protocol import wire


def _key_list(members: int, tag: str = "ab") -> wire.KeyListBody:
    return wire.KeyListBody(
        entries=[
            wire.KeyEntry(
                member=f"agent-{i}",
                enc_public=tag * 32,
                mask_public="cd" * 32,
                signature="ef" * 64,
                graph_nonce="12" * 16,
            )
            for i in range(members)
        ]
    )


def test_the_spliced_answer_is_byte_for_byte_the_encoded_one() -> None:
    cache = handlers._EncodedKeyList()
    keys = _key_list(5)
    spliced = wire.encode(wire.Accepted(accepted=True, keys=cache.of(keys)))  # type: ignore[arg-type]
    assert spliced == wire.encode(wire.Accepted(accepted=True, keys=keys))
    assert msgspec.json.decode(spliced, type=wire.Accepted).keys == keys
    assert cache.encoded(keys) == wire.encode(keys)


def test_a_list_is_encoded_once_and_a_new_list_anew() -> None:
    cache = handlers._EncodedKeyList()
    first = _key_list(3)
    assert cache.encoded(first) is cache.encoded(first)  # the same bytes object: no re-encode
    second = _key_list(3, tag="99")  # the next attempt's list: another object
    assert cache.encoded(second) == wire.encode(second)
    assert cache.encoded(second) != wire.encode(first)
    # an equal list that is another object is encoded again, to the same bytes
    again = _key_list(3, tag="99")
    assert cache.encoded(again) == cache.encoded(second)
