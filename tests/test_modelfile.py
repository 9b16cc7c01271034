"""Model file encoding and signed manifests."""

from __future__ import annotations

import json
import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import IntegrityError, PayloadTooLarge, SignatureError
from fedsec.modelfile import (
    ModelManifest,
    decode_model,
    encode_model,
    manifest_from_json,
    manifest_to_json,
    sha256_hex,
    sign_manifest,
    verify_manifest,
)

LIMIT = 1 << 20


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "fc.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(4).astype(np.float32),
    }


def test_round_trip_exact() -> None:
    arrays = _arrays()
    out = decode_model(encode_model(arrays), max_bytes=LIMIT, expected_names=arrays.keys())
    assert sorted(out) == sorted(arrays)
    for name, value in arrays.items():
        assert out[name].dtype == np.float32
        np.testing.assert_array_equal(out[name], value)


def test_encoding_is_deterministic_across_insertion_order_and_dtype() -> None:
    a = _arrays()
    b = {k: a[k].astype(np.float64) for k in reversed(list(a))}
    assert encode_model(a) == encode_model(b)
    assert sha256_hex(encode_model(a)) == sha256_hex(encode_model(b))


@settings(max_examples=30, deadline=None)
@given(
    st.dictionaries(
        st.text(alphabet="abcdefgh._", min_size=1, max_size=8),
        hnp.arrays(
            np.float32,
            hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
            elements=st.floats(-1e6, 1e6, width=32),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_round_trip_property(arrays: dict[str, np.ndarray]) -> None:
    data = encode_model(arrays)
    assert encode_model(arrays) == data
    out = decode_model(data, max_bytes=LIMIT)
    assert set(out) == set(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(out[name], value)
    assert encode_model(out) == data


def test_size_checked_before_parsing() -> None:
    with pytest.raises(PayloadTooLarge, match="limit is 10"):
        decode_model(b"\xff" * 11, max_bytes=10)


def test_unexpected_and_missing_names_refused() -> None:
    data = encode_model(_arrays())
    with pytest.raises(IntegrityError, match=r"unexpected tensors: fc\.bias"):
        decode_model(data, max_bytes=LIMIT, expected_names=["fc.weight"])
    with pytest.raises(IntegrityError, match="lacks tensors: other"):
        decode_model(data, max_bytes=LIMIT, expected_names=["fc.weight", "fc.bias", "other"])


def test_wrong_shape_refused() -> None:
    data = encode_model(_arrays())
    with pytest.raises(IntegrityError, match=r"'fc.bias' has shape \(4,\), expected \(5,\)"):
        decode_model(data, max_bytes=LIMIT, expected_shapes={"fc.bias": (5,)})


def test_other_dtype_refused() -> None:
    from safetensors.numpy import save

    data = save({"w": np.zeros(3, np.float64)})
    with pytest.raises(IntegrityError, match="'w' has dtype 'F64'"):
        decode_model(data, max_bytes=LIMIT)


def test_nonfinite_refused_both_ways() -> None:
    with pytest.raises(IntegrityError, match="NaN"):
        encode_model({"w": np.array([1.0, np.nan], np.float32)})
    from safetensors.numpy import save

    data = save({"w": np.array([np.inf], np.float32)})
    with pytest.raises(IntegrityError, match="NaN or infinite"):
        decode_model(data, max_bytes=LIMIT)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01\x00",
        struct.pack("<Q", 1 << 40) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 4) + b"{zz}",
        struct.pack("<Q", 2) + b"{}",
    ],
)
def test_malformed_headers_refused(data: bytes) -> None:
    with pytest.raises(IntegrityError):
        decode_model(data, max_bytes=LIMIT)


def test_offsets_beyond_data_refused() -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}})
    data = struct.pack("<Q", len(header)) + header.encode() + b"\x00" * 8
    with pytest.raises(IntegrityError, match="malformed"):
        decode_model(data, max_bytes=LIMIT)


def test_pickle_is_never_accepted() -> None:
    import pickle

    with pytest.raises(IntegrityError):
        decode_model(pickle.dumps({"w": [1.0]}), max_bytes=LIMIT)


# -- manifests ---------------------------------------------------------------------


def _manifest(signer: SigningIdentity, data: bytes, **over: object) -> ModelManifest:
    fields: dict[str, object] = dict(
        federation_id="fed-1",
        version=2,
        parent=1,
        round=1,
        sha256=sha256_hex(data),
        metrics={"accuracy": 0.9, "loss": 1},
        kind="aggregate",
        note="",
        created=1700000000,
    )
    fields.update(over)
    return sign_manifest(signer=signer, **fields)  # type: ignore[arg-type]


def test_manifest_sign_verify_and_json_round_trip() -> None:
    signer = SigningIdentity.generate()
    data = encode_model(_arrays())
    m = _manifest(signer, data)
    verify_manifest(m, signer.public_bytes, data, federation_id="fed-1")
    again = manifest_from_json(manifest_to_json(m))
    assert again == m
    assert ModelManifest.from_json(m.to_json()) == m
    verify_manifest(again, signer.public_bytes, data)


def test_manifest_tamper_detected() -> None:
    signer = SigningIdentity.generate()
    data = encode_model(_arrays())
    m = _manifest(signer, data)
    for change in (
        {"version": 3},
        {"parent": None},
        {"metrics": {"accuracy": 0.99, "loss": 1.0}},
        {"note": "x"},
        {"kind": "rollback"},
        {"created": 1.5},
    ):
        forged = msgspec.structs.replace(m, **change)
        with pytest.raises(SignatureError):
            verify_manifest(forged, signer.public_bytes)
    with pytest.raises(SignatureError):
        verify_manifest(m, SigningIdentity.generate().public_bytes)
    with pytest.raises(SignatureError, match="hex"):
        verify_manifest(msgspec.structs.replace(m, signature="zz"), signer.public_bytes)


def test_manifest_hash_mismatch_and_wrong_federation() -> None:
    signer = SigningIdentity.generate()
    data = encode_model(_arrays())
    m = _manifest(signer, data)
    with pytest.raises(IntegrityError, match=r"model file sha256 .* does not match manifest v2"):
        verify_manifest(m, signer.public_bytes, data + b"\x00")
    with pytest.raises(IntegrityError, match="federation 'fed-1', not 'fed-2'"):
        verify_manifest(m, signer.public_bytes, federation_id="fed-2")


def test_manifest_json_refuses_unknown_fields_and_bad_types() -> None:
    signer = SigningIdentity.generate()
    m = _manifest(signer, encode_model(_arrays()))
    doc = json.loads(manifest_to_json(m))
    with pytest.raises(IntegrityError, match="unknown field"):
        manifest_from_json(json.dumps({**doc, "extra": 1}).encode())
    with pytest.raises(IntegrityError, match="version"):
        manifest_from_json(json.dumps({**doc, "version": "2"}).encode())
    with pytest.raises(IntegrityError, match="kind"):
        manifest_from_json(json.dumps({**doc, "kind": "other"}).encode())
    with pytest.raises(IntegrityError, match="limit"):
        manifest_from_json(b" " * (1 << 17))


def test_manifest_field_checks() -> None:
    signer = SigningIdentity.generate()
    data = encode_model(_arrays())
    with pytest.raises(IntegrityError, match="sha256"):
        _manifest(signer, data, sha256="ABC")
    with pytest.raises(IntegrityError, match="parent 3"):
        _manifest(signer, data, parent=3)
    with pytest.raises(IntegrityError, match="not finite"):
        _manifest(signer, data, metrics={"loss": float("nan")})
