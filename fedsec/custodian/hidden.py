"""A hidden model (``he.model_visible_to_aggregator = false``): the custodian, which sees
each decrypted sum anyway, derives the new model itself and seals sum and model to the
recipients, so the aggregator stores and serves a version it cannot read.

Recipients are every active agent, auditor and custodian on the verified log's roster:
the members train on the next version, the auditors re-derive it, and the custodian reads
its own releases back as the parents of later versions (it keeps no model store).  A
member added to the roster after a release reads versions released after it joined.

:func:`seal_release` is sans-I/O; :func:`parent_model` is the one read from the
aggregator, and checks what it reads before using it.  The stored version is the whole
decryption body, so members open it without the log
(:func:`fedsec.protocol.he_release.open_release`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

import msgspec
import numpy as np

from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import dequantize_sum, ring_from_integers
from fedsec.crypto.sealing import seal_to_recipients
from fedsec.custodian.follow import LogFollower
from fedsec.derive import derive_model
from fedsec.errors import IntegrityError
from fedsec.learning.optimizers import FedAvg
from fedsec.modelfile import ModelManifest
from fedsec.protocol import he_release
from fedsec.protocol.limits import MAX_MODEL_BYTES
from fedsec.protocol.wire import DecryptionStatement, RoundSpec

#: Roles a hidden model is sealed to (see the module docstring).
RECIPIENT_ROLES = ("agent", "auditor", "custodian")


class ModelSource(Protocol):
    """The aggregator calls :func:`parent_model` makes."""

    async def manifest(self, version: int) -> ModelManifest: ...
    async def made_as(self, manifest: ModelManifest) -> str: ...
    async def model_bytes(self, version: int, max_bytes: int = ...) -> bytes: ...


def recipients(follower: LogFollower) -> dict[str, bytes]:
    """Recipient id -> Ed25519 public key: the active roster entries of the roles above."""
    return {
        member: entry.public_key_bytes
        for member, entry in sorted(follower.roster.items())
        if entry.is_active and entry.role in RECIPIENT_ROLES
    }


def seal_release(
    spec: RoundSpec,
    statement: DecryptionStatement,
    plaintext: bytes,
    parent: bytes,
    server_lr: float,
    to: Mapping[str, bytes],
) -> tuple[DecryptionStatement, bytes]:
    """Derive the round's model from ``parent`` and seal sum and model to ``to``.

    Args:
        spec: the attempt's signed spec (task, quantisation, the parent's version).
        statement: the unsigned statement of the decryption.
        plaintext: the decrypted integer sum (``<i8``), checked by the sum check.
        parent: the parent version's model file, in the clear.
        server_lr: FedAvg's server learning rate (the genesis's server section).
        to: recipient id -> Ed25519 public key.

    Returns:
        The statement with the hidden model's fields (unsigned), and the sealed release.

    Raises:
        RoundAborted: the total weight is zero.
        IntegrityError, TaskMismatch: ``parent`` is not a model of the spec's task.
        DecryptionError: a recipient key is malformed, or there is no recipient.
    """
    quant = spec.quant_spec()
    ring = ring_from_integers(np.frombuffer(plaintext, dtype=he_release.PLAINTEXT_DTYPE), quant)
    weighted, weight = dequantize_sum(ring, len(statement.contributors), quant)
    model, _ = derive_model(spec.task, parent, weighted, weight, FedAvg(server_lr))
    filled = msgspec.structs.replace(
        statement,
        ring_sha256=hashlib.sha256(ring.tobytes()).hexdigest(),
        weight_sum=weight,
        parent_version=spec.model_version,
        model_sha256=hashlib.sha256(model).hexdigest(),
        recipients=sorted(to),
    )
    sealed = seal_to_recipients(to, plaintext + model, he_release.release_context(filled))
    rest = he_release.SealedRelease(sealed.boxes, sealed.ciphertext).encode()
    return msgspec.structs.replace(filled, sealed_sha256=hashlib.sha256(rest).hexdigest()), rest


async def parent_model(
    source: ModelSource,
    custody_key: bytes,
    custodian: str,
    identity: SigningIdentity,
    spec: RoundSpec,
) -> bytes:
    """The model file of the version ``spec`` trained on, in the clear.

    The manifest must verify under the aggregator's key (checked by ``source``) and the
    file under the manifest; a sealed version must be a release signed by this custodian
    and sealed to it.  A rollback is read as the version it restores.

    Raises:
        IntegrityError, SignatureError, DecryptionError: something does not verify.
        FedsecError: the aggregator's refusal.
    """
    manifest = await source.manifest(spec.model_version)
    kind = await source.made_as(manifest)
    data = await source.model_bytes(spec.model_version, MAX_MODEL_BYTES)
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise IntegrityError(f"model v{spec.model_version} does not hash to its manifest")
    if kind != "sealed":
        return data
    opened = he_release.open_release(
        data, custody_key, custodian, identity.x25519_secret(), spec.dim + 1
    )
    return opened.model
