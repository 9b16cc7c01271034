"""Model files and their signed manifests, shared by agent, aggregator and audit.

A model travels as a safetensors file of float32 tensors, never as a pickle: decoding
parses a JSON header and copies raw little-endian floats, so a hostile file can at
worst be refused, not run.  Encoding is deterministic (sorted names, fixed metadata,
float32 little-endian) so the same weights always give the same bytes and therefore
the same sha256, which is what content addressing and re-aggregation audits compare.

A :class:`ModelManifest` names one model version: its sha256, its parent version, the
round that produced it and its validation metrics, signed by the aggregator in the
``"model-manifest"`` domain over the canonical JSON of every field but the signature.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json
from fedsec.errors import IntegrityError, PayloadTooLarge, SignatureError

MANIFEST_DOMAIN = "model-manifest"

# Fixed metadata written into every file: part of the hashed bytes, so it must never
# vary between writers.  One key only: safetensors keeps metadata in an unordered map,
# so two keys could be written in either order and change the hash.
MODEL_METADATA: dict[str, str] = {"format": "np"}

# The only tensor dtype accepted: updates are computed, clipped and quantized in float32,
# and one dtype keeps the encoding (hence the hash) unique for given weights.
MODEL_DTYPE = "F32"

# A safetensors header is a few hundred bytes per tensor; 16 MiB allows ~50k tensors
# (large transformer checkpoints have a few thousand) while bounding the JSON parse.
MAX_HEADER_BYTES = 16 * 1024 * 1024

# safetensors pads its header with spaces so the tensor data starts 8-byte aligned.
_HEADER_ALIGN = 8

# Manifests hold a handful of numbers, a note and metrics; 64 KiB is generous and keeps
# a hostile manifest from costing more than a page of memory to parse.
MAX_MANIFEST_BYTES = 64 * 1024

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_SIG_HEX = re.compile(r"^[0-9a-f]{128}$")

#: ``sealed``: an aggregate the aggregator cannot read (``he.model_visible_to_aggregator =
#: false``): its file is the key custodian's sealed release (fedsec.protocol.he_release),
#: and ``sha256`` names those bytes, not the model inside.
ManifestKind = Literal["initial", "aggregate", "rollback", "sealed"]
MANIFEST_KINDS: tuple[str, ...] = ("initial", "aggregate", "rollback", "sealed")

FloatArray = npt.NDArray[np.float32]


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class ByteSource(Protocol):
    """What :func:`read_model` reads a model file from: a binary file, ``io.BytesIO``."""

    def read(self, size: int, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class ByteSink(Protocol):
    """Where :func:`write_model` puts a model file's bytes: a binary file, a hash."""

    def write(self, data: memoryview | bytes, /) -> object: ...


def encode_model(arrays: Mapping[str, npt.ArrayLike]) -> bytes:
    """Encode named tensors as deterministic safetensors bytes.

    Args:
        arrays: tensor name -> array; every value is converted to little-endian float32.

    Returns:
        The file bytes; equal arrays always give equal bytes.

    Raises:
        IntegrityError: no tensors, a bad name, or a tensor with NaN/inf values.
    """
    head, tensors = _layout(arrays)
    # one copy of the tensors' bytes, into the result (join sizes it first)
    return b"".join([head, *(_raw(value) for _, value in tensors)])


def write_model(arrays: Mapping[str, npt.ArrayLike], sink: ByteSink) -> str:
    """Write the bytes :func:`encode_model` returns to ``sink``, a tensor at a time,
    without building them: the file costs no memory beyond the tensors themselves
    (and a float32 copy of a tensor that is not already one, contiguous).

    Returns:
        The sha256 hex of the bytes written (the model file's name in stores).

    Raises:
        IntegrityError: as :func:`encode_model`, before anything is written.
    """
    head, tensors = _layout(arrays)
    digest = hashlib.sha256(head)
    sink.write(head)
    for _, value in tensors:
        raw = _raw(value)
        digest.update(raw)
        sink.write(raw)
    return digest.hexdigest()


def model_sha256(arrays: Mapping[str, npt.ArrayLike]) -> str:
    """sha256 hex of :func:`encode_model`'s bytes, computed without building them.

    Raises:
        IntegrityError: as :func:`encode_model`.
    """
    return write_model(arrays, _NoSink())


class _NoSink:
    def write(self, data: memoryview | bytes, /) -> object:
        return None


def _layout(
    arrays: Mapping[str, npt.ArrayLike],
) -> tuple[bytes, list[tuple[str, np.ndarray[Any, Any]]]]:
    """The file's first bytes (length, header) and its tensors in file order.

    The bytes are safetensors' own for these tensors (tests/test_modelfile.py compares
    them with ``safetensors.numpy.save`` byte for byte): a little-endian u64 header
    length, then the header, compact JSON with raw UTF-8 as serde_json writes it,
    metadata first, tensors sorted by name (one dtype, so safetensors' sort by
    alignment then name is by name), padded with spaces to a multiple of 8 bytes;
    then each tensor's little-endian bytes in that order.
    """
    if not arrays:
        raise IntegrityError("a model needs at least one tensor")
    tensors: list[tuple[str, np.ndarray[Any, Any]]] = []
    header: dict[str, Any] = {"__metadata__": dict(MODEL_METADATA)}
    offset = 0
    for name in sorted(arrays):
        _check_name(name)
        value = np.ascontiguousarray(np.asarray(arrays[name], dtype="<f4"))
        if not _all_finite(value):
            raise IntegrityError(f"tensor {name!r} holds NaN or infinite values")
        tensors.append((name, value))
        end = offset + value.nbytes
        header[name] = {
            "dtype": MODEL_DTYPE,
            "shape": list(value.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text, tensors


#: Elements checked for NaN and infinity at a time: the check's boolean temporary stays
#: at 256 KiB, where a whole tensor's is a byte a parameter (48 MiB at 50M, the peak of
#: reading or writing such a model).
_FINITE_RUN = 1 << 18


def _all_finite(value: np.ndarray[Any, Any]) -> bool:
    """Whether every element of ``value`` is finite, checked a run at a time."""
    flat = value.reshape(-1)
    return all(
        bool(np.isfinite(flat[i : i + _FINITE_RUN]).all()) for i in range(0, flat.size, _FINITE_RUN)
    )


def _raw(value: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of a contiguous array, without copying them."""
    return value.reshape(-1).data.cast("B")


def decode_model(
    data: bytes,
    *,
    max_bytes: int,
    expected_names: Collection[str] | None = None,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, FloatArray]:
    """Decode and validate a model file received from anywhere.

    The size is checked before anything is parsed, and the header (names, dtypes,
    shapes, offsets) before any tensor is materialised.

    Args:
        data: safetensors bytes.
        max_bytes: refuse larger inputs (a configured limit).
        expected_names: if given, the file must hold exactly these tensor names.
        expected_shapes: if given, each named tensor must have this shape.

    Returns:
        tensor name -> float32 array (writable copies).

    Raises:
        PayloadTooLarge: ``data`` is longer than ``max_bytes``.
        IntegrityError: malformed file, wrong dtype, unexpected/missing names or shapes,
            or NaN/inf values.
    """
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"model file is {len(data)} bytes, the limit is {max_bytes}")
    arrays, _ = read_model(
        io.BytesIO(data), len(data), expected_names=expected_names, expected_shapes=expected_shapes
    )
    return arrays


def read_model(
    source: ByteSource,
    size: int,
    *,
    expected_names: Collection[str] | None = None,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    into: Mapping[str, FloatArray] | None = None,
) -> tuple[dict[str, FloatArray], str]:
    """Decode and validate the ``size`` bytes of a model file that ``source`` reads
    next, a tensor at a time: each tensor's bytes are read straight into its array, so
    the file's bytes are never held whole (a store reads its own files this way).

    The header (names, dtypes, shapes, offsets) is checked before any tensor is read.

    Args:
        source: a binary file positioned at the model file's first byte.
        size: the model file's length (the caller has checked it against its limit).
        expected_names, expected_shapes: as for :func:`decode_model`.
        into: tensor name -> a writable, contiguous little-endian float32 array of the
            tensor's shape to read it into (e.g. a model's own parameters, so the file
            costs no copy beside them); the file must hold exactly these names.  If the
            read fails after the header, the arrays hold part of the file.

    Returns:
        tensor name -> float32 array (writable; views of ``into``'s arrays where
        given), and the sha256 hex of the bytes read.

    Raises:
        IntegrityError: as :func:`decode_model`, or ``source`` ends early; with
            ``into``, names or shapes that are not its arrays' (before any is written).
        ValueError: an array of ``into`` that is not such an array.
    """
    if into is not None:
        for name, target in into.items():
            if target.dtype != np.dtype("<f4") or not target.flags.c_contiguous:
                raise ValueError(f"tensor {name!r} is read into contiguous <f4 arrays only")
            if not target.flags.writeable:
                raise ValueError(f"tensor {name!r} cannot be read into a read-only array")
        expected_names = list(into)
        expected_shapes = {name: tuple(target.shape) for name, target in into.items()}
    digest = hashlib.sha256()
    header, header_bytes = _parse_header(source, size, digest)
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntegrityError("model file metadata is not an object of strings")
    names = [k for k in header if k != "__metadata__"]
    if not names:
        raise IntegrityError("model file holds no tensors")
    for name in names:
        _check_name(name)
        info = header[name]
        if not isinstance(info, dict):
            raise IntegrityError(f"model file: header entry for {name!r} is not an object")
        dtype = info.get("dtype")
        if dtype != MODEL_DTYPE:
            raise IntegrityError(
                f"tensor {name!r} has dtype {dtype!r}, only {MODEL_DTYPE} is accepted"
            )
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise IntegrityError(f"tensor {name!r} has a malformed shape {shape!r}")
    if expected_names is not None:
        expected = set(expected_names)
        unexpected = sorted(set(names) - expected)
        missing = sorted(expected - set(names))
        if unexpected:
            raise IntegrityError(f"model file holds unexpected tensors: {', '.join(unexpected)}")
        if missing:
            raise IntegrityError(f"model file lacks tensors: {', '.join(missing)}")
    if expected_shapes is not None:
        for name, want in expected_shapes.items():
            if name in header and tuple(header[name]["shape"]) != tuple(want):
                got = tuple(header[name]["shape"])
                raise IntegrityError(f"tensor {name!r} has shape {got}, expected {tuple(want)}")
    result: dict[str, FloatArray] = {}
    for name, _, count in _tensor_layout(header, names, size - 8 - header_bytes):
        # the tensors tile the data region in this order: read in sequence, one copy
        value = np.empty(count, dtype="<f4") if into is None else into[name].reshape(-1)
        raw = value.data.cast("B")
        _read_into(source, raw, name)
        digest.update(raw)
        value = value.astype(np.float32, copy=False).reshape(header[name]["shape"])
        if not _all_finite(value):
            raise IntegrityError(f"tensor {name!r} holds NaN or infinite values")
        result[name] = value
    return dict(sorted(result.items())), digest.hexdigest()


def _read_into(source: ByteSource, buffer: memoryview, name: str) -> None:
    filled = 0
    while filled < len(buffer):
        got = source.readinto(buffer[filled:])
        if not got:
            raise IntegrityError(f"model file ends inside tensor {name!r}")
        filled += got


def _tensor_layout(
    header: Mapping[str, Any], names: list[str], data_bytes: int
) -> list[tuple[str, int, int]]:
    """(name, first byte, element count) of each tensor, in file order, once the
    offsets are checked as safetensors checks them: in offset order the tensors tile
    the data region from its first byte to the file's last, each exactly as long as
    its shape says.

    Raises:
        IntegrityError: malformed offsets, a gap, an overlap, a length that is not the
            shape's, or bytes past the last tensor.
    """
    placed: list[tuple[int, int, str, int]] = []
    for name in names:
        offsets = header[name].get("data_offsets")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        ):
            raise IntegrityError(f"tensor {name!r} has malformed data offsets {offsets!r}")
        count = math.prod(header[name]["shape"])
        placed.append((offsets[0], offsets[1], name, count))
    placed.sort()
    layout: list[tuple[str, int, int]] = []
    end = 0
    for begin, stop, name, count in placed:
        if begin != end or stop < begin:
            raise IntegrityError(
                f"model file is malformed: tensor {name!r} offsets leave a gap or overlap"
            )
        if stop - begin != count * 4:
            raise IntegrityError(
                f"model file is malformed: tensor {name!r} holds {stop - begin} bytes, "
                f"its shape needs {count * 4}"
            )
        layout.append((name, begin, count))
        end = stop
    if end != data_bytes:
        raise IntegrityError(
            f"model file is malformed: its tensors end at byte {end} of {data_bytes}"
        )
    return layout


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or name == "__metadata__" or len(name) > 1024:
        raise IntegrityError(f"invalid tensor name {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no file can name it
        raise IntegrityError(f"invalid tensor name {name!r}: not valid UTF-8") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: a name given twice is refused, never
    resolved (which of the two would a reader take?)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a key appears twice")
    return result


def _parse_header(source: ByteSource, size: int, digest: Any) -> tuple[dict[str, Any], int]:
    """The header of a ``size``-byte model file read from ``source`` (its bytes added
    to ``digest``) and its length."""
    if size < 8:
        raise IntegrityError(f"model file is {size} bytes, too short for a safetensors header")
    length = source.read(8)
    if len(length) != 8:
        raise IntegrityError("model file ends inside its header length")
    (header_len,) = struct.unpack("<Q", length)
    if header_len > MAX_HEADER_BYTES or header_len > size - 8:
        raise IntegrityError(
            f"model file header length {header_len} exceeds the file or the "
            f"{MAX_HEADER_BYTES}-byte limit"
        )
    raw = source.read(header_len)
    if len(raw) != header_len:
        raise IntegrityError("model file ends inside its header")
    digest.update(length)
    digest.update(raw)
    if not raw.startswith(b"{"):  # as safetensors: no other encoding, no leading bytes
        raise IntegrityError("model file header does not start with '{'")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"model file header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise IntegrityError("model file header is not a JSON object")
    return header, header_len


class ModelManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One signed model version.  ``signature`` is hex Ed25519 over all other fields."""

    federation_id: str
    version: int
    parent: int | None
    round: int | None
    sha256: str
    created: float
    metrics: dict[str, float]
    kind: ManifestKind
    note: str
    signature: str

    def signed_bytes(self) -> bytes:
        """The exact bytes the signature covers (canonical JSON, signature excluded)."""
        return _signed_payload(
            federation_id=self.federation_id,
            version=self.version,
            parent=self.parent,
            round=self.round,
            sha256=self.sha256,
            created=self.created,
            metrics=self.metrics,
            kind=self.kind,
            note=self.note,
        )

    def to_json(self) -> bytes:
        """Serialise for storage or the wire."""
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> ModelManifest:
        """Parse a manifest, refusing unknown fields, wrong types and oversize input.

        Raises:
            IntegrityError: malformed manifest.
        """
        return manifest_from_json(data)


def _signed_payload(
    *,
    federation_id: str,
    version: int,
    parent: int | None,
    round: int | None,
    sha256: str,
    created: float,
    metrics: Mapping[str, float],
    kind: str,
    note: str,
) -> bytes:
    # Floats are normalised so an int passed by a caller and the float it becomes after
    # a JSON round trip sign identically.
    return canonical_json(
        {
            "federation_id": federation_id,
            "version": int(version),
            "parent": None if parent is None else int(parent),
            "round": None if round is None else int(round),
            "sha256": sha256,
            "created": float(created),
            "metrics": {str(k): float(v) for k, v in metrics.items()},
            "kind": kind,
            "note": note,
        }
    )


def _check_fields(
    version: int,
    parent: int | None,
    round: int | None,
    sha256: str,
    created: float,
    metrics: Mapping[str, float],
    kind: str,
) -> None:
    if version < 1:
        raise IntegrityError(f"manifest version must be >= 1, got {version}")
    if parent is not None and not 1 <= parent < version:
        raise IntegrityError(f"manifest parent {parent} must be an earlier version than {version}")
    if round is not None and round < 0:
        raise IntegrityError(f"manifest round must be >= 0, got {round}")
    if not _SHA256_HEX.fullmatch(sha256):
        raise IntegrityError(f"manifest sha256 {sha256!r} is not 64 lowercase hex digits")
    if not math.isfinite(created):
        raise IntegrityError("manifest created time is not finite")
    for key, value in metrics.items():
        if not math.isfinite(float(value)):
            raise IntegrityError(f"manifest metric {key!r} is not finite")
    if kind not in MANIFEST_KINDS:
        raise IntegrityError(f"manifest kind {kind!r} is not one of {', '.join(MANIFEST_KINDS)}")


def sign_manifest(
    *,
    federation_id: str,
    version: int,
    parent: int | None,
    round: int | None,
    sha256: str,
    metrics: Mapping[str, float],
    kind: ManifestKind,
    signer: SigningIdentity,
    note: str = "",
    created: float | None = None,
) -> ModelManifest:
    """Build and sign a manifest.

    Args:
        created: unix time; defaults to now.

    Returns:
        The signed manifest.

    Raises:
        IntegrityError: a field is out of range (bad hash, version, non-finite metric).
    """
    when = time.time() if created is None else float(created)
    _check_fields(version, parent, round, sha256, when, metrics, kind)
    fields: dict[str, Any] = {
        "federation_id": federation_id,
        "version": int(version),
        "parent": parent,
        "round": round,
        "sha256": sha256,
        "created": when,
        "metrics": {str(k): float(v) for k, v in metrics.items()},
        "kind": kind,
        "note": note,
    }
    signature = signer.sign(MANIFEST_DOMAIN, _signed_payload(**fields))
    return ModelManifest(**fields, signature=signature.hex())


def verify_manifest(
    manifest: ModelManifest,
    aggregator_public_key: bytes,
    data: bytes | None = None,
    *,
    federation_id: str | None = None,
) -> None:
    """Check a manifest's signature and, if given, that ``data`` is the file it names.

    Args:
        aggregator_public_key: the 32-byte Ed25519 key of the aggregator.
        data: the model file bytes, to compare with ``manifest.sha256``.
        federation_id: if given, the manifest must belong to this federation.

    Raises:
        SignatureError: the signature is malformed or does not verify.
        IntegrityError: fields out of range, wrong federation, or file hash mismatch.
    """
    if not _SIG_HEX.fullmatch(manifest.signature):
        raise SignatureError(f"manifest v{manifest.version}: signature is not 64 bytes of hex")
    _check_fields(
        manifest.version,
        manifest.parent,
        manifest.round,
        manifest.sha256,
        manifest.created,
        manifest.metrics,
        manifest.kind,
    )
    PublicIdentity(aggregator_public_key).verify(
        MANIFEST_DOMAIN, manifest.signed_bytes(), bytes.fromhex(manifest.signature)
    )
    if federation_id is not None and manifest.federation_id != federation_id:
        raise IntegrityError(
            f"manifest v{manifest.version} belongs to federation {manifest.federation_id!r}, "
            f"not {federation_id!r}"
        )
    if data is not None:
        actual = sha256_hex(data)
        if actual != manifest.sha256:
            raise IntegrityError(
                f"model file sha256 {actual} does not match manifest v{manifest.version} "
                f"sha256 {manifest.sha256}"
            )


def manifest_to_json(manifest: ModelManifest) -> bytes:
    """Serialise a manifest as JSON bytes."""
    return msgspec.json.encode(manifest)


def manifest_from_json(data: bytes) -> ModelManifest:
    """Parse a manifest, refusing unknown fields, wrong types and oversize input.

    Raises:
        IntegrityError: malformed manifest (the signature is *not* checked here).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise IntegrityError(f"manifest is {len(data)} bytes, the limit is {MAX_MANIFEST_BYTES}")
    try:
        return msgspec.json.decode(data, type=ModelManifest)
    except msgspec.DecodeError as exc:
        raise IntegrityError(f"manifest is malformed: {exc}") from None
