"""Model file encoding and signed manifests."""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import IntegrityError, PayloadTooLarge, SignatureError
from fedsec.modelfile import (
    MODEL_METADATA,
    ModelManifest,
    decode_model,
    encode_model,
    manifest_from_json,
    manifest_to_json,
    model_sha256,
    sha256_hex,
    sign_manifest,
    verify_manifest,
    write_model,
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


# -- the streaming encoder against safetensors' own bytes ---------------------------


def _safetensors_bytes(arrays: Mapping[str, Any]) -> bytes:
    """What ``safetensors.numpy.save`` writes for the tensors ``encode_model`` encodes:
    the reference the streaming encoder must equal byte for byte."""
    from safetensors.numpy import save

    prepared = {
        name: np.ascontiguousarray(np.asarray(value, dtype="<f4"))
        for name, value in sorted(arrays.items())
    }
    return bytes(save(prepared, metadata=dict(MODEL_METADATA)))


def _assert_same_bytes(ours: bytes, reference: bytes) -> None:
    if ours != reference:
        at = next(
            (i for i, (a, b) in enumerate(zip(ours, reference, strict=False)) if a != b),
            min(len(ours), len(reference)),
        )
        raise AssertionError(
            f"encoded bytes differ from safetensors' at byte {at} "
            f"(lengths {len(ours)} and {len(reference)}): "
            f"{ours[max(0, at - 20) : at + 20]!r} vs {reference[max(0, at - 20) : at + 20]!r}"
        )


def _assert_encodes_like_safetensors(arrays: Mapping[str, Any]) -> None:
    reference = _safetensors_bytes(arrays)
    _assert_same_bytes(encode_model(arrays), reference)
    sink = io.BytesIO()
    digest = write_model(arrays, sink)
    _assert_same_bytes(sink.getvalue(), reference)
    assert digest == model_sha256(arrays) == hashlib.sha256(reference).hexdigest()


# tensor names as a state_dict or a hostile writer may spell them: dots, quotes,
# backslashes, control characters, non-ASCII (no lone surrogates: no file can hold one)
_NAMES = st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12).filter(
    lambda name: name != "__metadata__"
)


@st.composite
def _tensor(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(["<f4", ">f4", "<f2", "<f8", "<i8"]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    value = draw(hnp.arrays(dtype, shape, elements=st.integers(-1000, 1000)))
    layout = draw(st.sampled_from(["as is", "transposed", "strided"]))
    if layout == "transposed":
        value = value.T
    elif layout == "strided" and value.ndim:
        value = np.repeat(value, 2, axis=0)[::2]  # equal values, not contiguous
    return value


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_NAMES, _tensor(), min_size=1, max_size=6))
def test_streaming_encoder_writes_safetensors_bytes(arrays: dict[str, np.ndarray]) -> None:
    _assert_encodes_like_safetensors(arrays)


def test_streaming_encoder_writes_safetensors_bytes_for_torch_models() -> None:
    import torch

    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)),
        # buffers: running statistics and an int64 batch counter
        torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten()),
        torch.nn.Sequential(torch.nn.Embedding(40, 6), torch.nn.LayerNorm(6), torch.nn.GRU(6, 4)),
        torch.nn.Linear(0, 3),  # an empty weight
    ]
    models[1].train()(torch.randn(2, 3, 5, 5))  # buffers away from their initial values
    for model in models:
        state = model.state_dict()
        _assert_encodes_like_safetensors(state)
        # parameters as the encoder sees a transposed or sliced view of them
        views = {name: t.T if t.ndim == 2 else t for name, t in state.items()}
        _assert_encodes_like_safetensors(views)


def test_the_comparison_catches_a_one_byte_difference() -> None:
    arrays = _arrays()
    reference = _safetensors_bytes(arrays)
    for at in (0, 8, len(reference) // 2, len(reference) - 1):
        changed = bytearray(reference)
        changed[at] ^= 1
        with pytest.raises(AssertionError, match=f"at byte {at} "):
            _assert_same_bytes(bytes(changed), reference)
    with pytest.raises(AssertionError, match="lengths"):
        _assert_same_bytes(reference + b" ", reference)


def test_encoder_refuses_before_writing() -> None:
    sink = io.BytesIO()
    with pytest.raises(IntegrityError, match="NaN"):
        write_model({"a": np.ones(3), "b": np.array([1.0, np.nan])}, sink)
    with pytest.raises(IntegrityError, match="not valid UTF-8"):
        write_model({"\ud800": np.ones(1)}, sink)
    with pytest.raises(IntegrityError, match="at least one"):
        write_model({}, sink)
    assert sink.getvalue() == b""


# -- the decoder against safetensors' own ---------------------------------------------


def _header_of(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _file(header: object, body: bytes, *, raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _mutations(data: bytes, draw: st.DrawFn) -> bytes:
    """A model file changed the ways a hostile or broken writer could change it."""
    header, body = _header_of(data)
    names = [k for k in header if k != "__metadata__"]
    name = draw(st.sampled_from(names))
    shift = draw(st.integers(-8, 8))
    kind = draw(
        st.sampled_from(
            [
                "begin",
                "end",
                "move",
                "shape",
                "body",
                "swap",
                "metadata",
                "extra",
                "flip",
                "length",
                "none",
            ]
        )
    )
    if kind == "begin":
        header[name]["data_offsets"][0] = max(0, header[name]["data_offsets"][0] + shift)
    elif kind == "end":
        header[name]["data_offsets"][1] = max(0, header[name]["data_offsets"][1] + shift)
    elif kind == "move":  # a gap or an overlap of the same length
        begin, end = header[name]["data_offsets"]
        shift = max(shift, -begin)
        header[name]["data_offsets"] = [begin + shift, end + shift]
        body += b"\0" * max(0, shift)
    elif kind == "shape":
        header[name]["shape"] = draw(st.lists(st.integers(0, 6), max_size=3))
    elif kind == "body":
        body = body[: max(0, len(body) + shift)] if shift < 0 else body + b"\0" * shift
    elif kind == "swap" and len(names) > 1:
        other = draw(st.sampled_from([n for n in names if n != name]))
        a, b = header[name], header[other]
        a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    elif kind == "metadata":
        header["__metadata__"] = draw(
            st.sampled_from([None, {}, {"format": 1}, {"format": "pt", "x": "y"}, []])
        )
    elif kind == "extra":
        header[name][draw(st.sampled_from(["extra", "dtype"]))] = draw(
            st.sampled_from(["F32", "F64", 1, None])
        )
    elif kind == "flip":
        flipped = bytearray(json.dumps(header).encode())
        flipped[draw(st.integers(0, len(flipped) - 1))] ^= 1 << draw(st.integers(0, 7))
        return _file(None, body, raw_header=bytes(flipped))
    elif kind == "length":
        text = json.dumps(header).encode()
        return struct.pack("<Q", max(0, len(text) + shift)) + text + body
    return _file(header, body)


@st.composite
def _model_files(draw: st.DrawFn) -> bytes:
    arrays = draw(
        st.dictionaries(
            st.sampled_from(["w", "b", "conv.weight", "norm.bias"]),
            hnp.arrays(
                np.float32,
                hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
                elements=st.floats(-10, 10, width=32),
            ),
            min_size=1,
            max_size=3,
        )
    )
    return _mutations(encode_model(arrays), draw)


@settings(max_examples=300, deadline=None)
@given(_model_files())
def test_decoder_accepts_only_what_safetensors_accepts_and_reads_it_alike(data: bytes) -> None:
    """The decoder validates the layout itself (so it copies each tensor once, where
    safetensors' loader copied it twice): a file it accepts must be one safetensors
    accepts, holding the same tensors."""
    from safetensors.numpy import load

    try:
        ours = decode_model(data, max_bytes=LIMIT)
    except IntegrityError:
        return  # refusing more than safetensors (duplicate keys, null metadata) is safe
    theirs = load(data)
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        assert value.flags.writeable and value.dtype == np.float32
        np.testing.assert_array_equal(value, theirs[name])
        assert value.shape == theirs[name].shape


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "holds 4 bytes"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "gap or overlap"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, "malformed data offsets"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}, "malformed data"),
        (
            {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": 1},
            "metadata",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            "gap or overlap",
        ),
    ],
)
def test_bad_layouts_refused(header: dict[str, Any], match: str) -> None:
    with pytest.raises(IntegrityError, match=match):
        decode_model(_file(header, b"\0" * 8), max_bytes=LIMIT)


def test_header_encodings_and_repeated_names_refused() -> None:
    entry = '"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    for text, match in (
        (("{" + entry + "}").encode("utf-16"), "start with"),
        (b" {" + entry.encode() + b"}", "start with"),
        (("{" + entry + "," + entry + "}").encode(), "twice"),
        (b'{"w\xff":1}', "not JSON"),
    ):
        with pytest.raises(IntegrityError, match=match):
            decode_model(_file(None, b"\0" * 4, raw_header=text), max_bytes=LIMIT)


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
