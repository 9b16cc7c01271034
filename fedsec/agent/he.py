"""The member's side of homomorphic summation: the federation's public CKKS context,
trusted only once its key custodian's signed statement checks out, and encryption of
the quantized update under it.

The aggregator serves the context, so it could substitute one whose secret key it holds
and read every update: the statement is verified with the custodian's key from the
admin-signed roster (the agent's pinned roster), its hash must be the one the signed
round spec names, and the context must carry no secret key.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib

import numpy as np

from fedsec.agent.pinned_roster import PinnedRoster
from fedsec.aggregator_client import AggregatorClient
from fedsec.crypto import he
from fedsec.crypto.quantize import RingVector
from fedsec.errors import IntegrityError, PayloadError
from fedsec.protocol.wire import HeContext, RoundSpec

#: Updates this many values long or more are encrypted in a worker thread, so the event
#: loop keeps answering (one ciphertext of 4,096 values takes ~4 ms on one core).
INLINE_ENCRYPTION_MAX_VALUES = 16_384


class HeContexts:
    """The verified public contexts this member encrypts under, by their SHA-256."""

    def __init__(self, roster: PinnedRoster) -> None:
        self._roster = roster
        self._contexts: dict[str, he.PublicContext] = {}

    async def for_spec(self, client: AggregatorClient, spec: RoundSpec) -> he.PublicContext:
        """The context ``spec`` names, fetched and verified on first use.

        Raises:
            IntegrityError: the spec names no context or custodian, the served context is
                not the one it names, or the statement is not the custodian's.
            SignatureError: the statement's signature does not verify.
            CryptoError, PayloadError: the context does not load as a public one.
        """
        if not spec.he_context_sha256 or not spec.custodian:
            raise IntegrityError("the round spec asks for he but names no context or custodian")
        cached = self._contexts.get(spec.he_context_sha256)
        if cached is not None:
            return cached
        served = await client.he_context()
        custodians = await self._roster.keys(client, spec.federation_id, role="custodian")
        key = custodians.get(spec.custodian)
        if key is None:
            raise IntegrityError(
                f"the roster names no active custodian {spec.custodian!r}, whom the spec names"
            )
        context = verify_context(served, spec, key)
        self._contexts[spec.he_context_sha256] = context
        return context


def verify_context(served: HeContext, spec: RoundSpec, custodian_key: bytes) -> he.PublicContext:
    """The public context of ``served``, when its statement is the custodian's and it is
    the one ``spec`` names.

    Raises:
        IntegrityError, SignatureError, CryptoError, PayloadError: see
            :meth:`HeContexts.for_spec`.
    """
    statement = served.statement
    statement.verify(custodian_key)
    if (statement.federation_id, statement.custodian) != (spec.federation_id, spec.custodian):
        raise IntegrityError("the context statement names another federation or custodian")
    params = he.HeParams(
        statement.poly_modulus_degree, tuple(statement.coeff_mod_bit_sizes), statement.scale_bits
    )
    limit = params.context_max_bytes(secret=False)
    if len(served.context) > 4 * (limit // 3 + 1):
        raise PayloadError(f"the served context exceeds {limit} bytes")
    try:
        data = base64.b64decode(served.context, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError("the served context is not base64") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != statement.context_sha256 or digest != spec.he_context_sha256:
        raise IntegrityError(
            "the served context is not the one the custodian signed and the spec names"
        )
    return he.load_public_context(data, params, limit)


async def encrypt_update(
    context: he.PublicContext, quantized: RingVector, workers: int | None = None
) -> bytes:
    """The framed ciphertexts of ``quantized`` (its integers as float64 values).

    Args:
        context: the verified public context.
        quantized: the update.
        workers: processes to encrypt on; None = every CPU this agent may use (updates
            under :data:`fedsec.crypto.he.POOL_MIN_CHUNKS` chunks stay on one core).

    Raises:
        CryptoError: the values exceed the context's headroom, or a worker process died.
    """
    values = np.asarray(quantized, dtype=np.float64)
    if values.size < INLINE_ENCRYPTION_MAX_VALUES:
        return he.frame_chunks(he.encrypt(context, values))
    # the pool, when used, is started and awaited from this worker thread
    chunks = await asyncio.to_thread(
        he.encrypt, context, values, he.available_cpus() if workers is None else workers
    )
    return he.frame_chunks(chunks)
