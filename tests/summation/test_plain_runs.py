"""A trusted round reads each upload from its packed bytes a run at a time: the running
sum is the one of unpacking it whole, and a refused upload changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from fedsec.crypto.quantize import pack
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import BadVector
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.update_codec import DECODE_BLOCK
from fedsec.summation.plain import PlainSession
from tests.protocol.test_update_codec import _spec


def test_a_trusted_round_sums_uploads_read_in_runs_and_refuses_without_change() -> None:
    spec = _spec(DECODE_BLOCK + 5, members=3, bits=8, secure_sum="none")
    codec = codec_for(spec)
    session = PlainSession(spec, min_agents=1)
    rng = np.random.default_rng(0)
    vectors = [
        rng.integers(0, codec.quant.levels + 1, codec.length, np.uint64).astype(codec.quant.dtype)
        for _ in range(2)
    ]
    expected, weight = np.zeros(spec.dim), 0.0
    for member, vector in zip(spec.cohort, vectors, strict=False):
        session.receive("masked_input", MaskedInput(member, pack(vector, spec.ring_bits)))
        update, w = codec.decode_one(vector)
        expected += update
        weight += w
    assert session.total.tobytes() == expected.tobytes() and session.weight == weight
    bad = vectors[0].copy()
    bad[DECODE_BLOCK + 1] = codec.quant.levels + 1  # in the last run, after a good one
    last = spec.cohort[2]
    with pytest.raises(BadVector, match=f"{last}'s update: values above"):
        session.receive("masked_input", MaskedInput(last, pack(bad, spec.ring_bits)))
    with pytest.raises(BadVector, match="bytes"):
        session.receive("masked_input", MaskedInput(last, pack(bad, spec.ring_bits)[:-1]))
    assert session.total.tobytes() == expected.tobytes() and session.weight == weight
    assert session.members == list(spec.cohort[:2])
