"""The member trusts a homomorphic context only when its key custodian signed it and the
round spec names it: an aggregator that served a context of its own would read every
update."""

from __future__ import annotations

import base64
import hashlib
from functools import cache

import numpy as np
import pytest

from fedsec.agent.he import encrypt_update, verify_context
from fedsec.crypto import he
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import FedsecError, IntegrityError, SignatureError
from fedsec.protocol import wire

FED = "fed-he"
PARAMS = he.HeParams()
CUSTODIAN = SigningIdentity(hashlib.sha256(b"custodian").digest())
AGGREGATOR = SigningIdentity(hashlib.sha256(b"aggregator").digest())


@cache
def _keys() -> tuple[bytes, bytes]:
    return he.generate_keys(PARAMS)


def _served(
    context: bytes, signer: SigningIdentity = CUSTODIAN, **changes: object
) -> wire.HeContext:
    fields: dict[str, object] = {
        "federation_id": FED,
        "custodian": "kh",
        "poly_modulus_degree": PARAMS.poly_modulus_degree,
        "coeff_mod_bit_sizes": list(PARAMS.coeff_mod_bit_sizes),
        "scale_bits": PARAMS.scale_bits,
        "context_sha256": hashlib.sha256(context).hexdigest(),
    }
    fields.update(changes)
    statement = wire.HeContextStatement(**fields).sign(signer)  # type: ignore[arg-type]
    return wire.HeContext(statement=statement, context=base64.b64encode(context).decode())


class _Spec:
    """The two fields of a RoundSpec the check reads (a full spec is not needed)."""

    def __init__(self, context_sha256: str, custodian: str = "kh") -> None:
        self.federation_id = FED
        self.he_context_sha256 = context_sha256
        self.custodian = custodian


def _spec_for(context: bytes) -> wire.RoundSpec:
    return _Spec(hashlib.sha256(context).hexdigest())  # type: ignore[return-value]


def test_the_custodians_context_named_by_the_spec_is_trusted() -> None:
    _, public = _keys()
    ctx = verify_context(_served(public), _spec_for(public), CUSTODIAN.public_bytes)
    assert isinstance(ctx, he.PublicContext)


def test_a_context_signed_by_the_aggregator_is_refused() -> None:
    _, public = _keys()
    with pytest.raises(SignatureError):
        verify_context(_served(public, AGGREGATOR), _spec_for(public), CUSTODIAN.public_bytes)


def test_a_substituted_context_under_the_genuine_statement_is_refused() -> None:
    _, public = _keys()
    _, other = he.generate_keys(PARAMS)  # the aggregator's own key pair
    genuine = _served(public)
    swapped = wire.HeContext(statement=genuine.statement, context=base64.b64encode(other).decode())
    with pytest.raises(IntegrityError, match="not the one"):
        verify_context(swapped, _spec_for(public), CUSTODIAN.public_bytes)


def test_a_context_other_than_the_specs_is_refused() -> None:
    _, public = _keys()
    _, other = he.generate_keys(PARAMS)
    with pytest.raises(IntegrityError):
        verify_context(_served(other), _spec_for(public), CUSTODIAN.public_bytes)


def test_a_statement_for_another_federation_or_custodian_is_refused() -> None:
    _, public = _keys()
    for change in ({"federation_id": "elsewhere"}, {"custodian": "someone-else"}):
        with pytest.raises(IntegrityError, match="another federation or custodian"):
            verify_context(_served(public, **change), _spec_for(public), CUSTODIAN.public_bytes)


def test_a_context_holding_the_secret_key_is_refused() -> None:
    secret, _ = _keys()
    with pytest.raises(FedsecError):
        verify_context(_served(secret), _spec_for(secret), CUSTODIAN.public_bytes)


def test_not_base64_is_refused_with_a_sentence() -> None:
    _, public = _keys()
    served = _served(public)
    broken = wire.HeContext(statement=served.statement, context="not base64 !!")
    with pytest.raises(FedsecError, match="base64"):
        verify_context(broken, _spec_for(public), CUSTODIAN.public_bytes)


@pytest.mark.asyncio
async def test_the_encrypted_update_decrypts_to_the_quantized_integers() -> None:
    secret, public = _keys()
    ctx = he.load_public_context(public, PARAMS, PARAMS.context_max_bytes(secret=False))
    quantized = np.random.default_rng(0).integers(0, 256, size=5211).astype(np.uint32)
    body = await encrypt_update(ctx, quantized)
    chunks = he.unframe_chunks(body, PARAMS, quantized.size)
    key = he.load_secret_context(secret, PARAMS, PARAMS.context_max_bytes(secret=True))
    values = he.decrypt_sum(key, chunks, quantized.size)
    np.testing.assert_array_equal(np.rint(values).astype(np.int64), quantized.astype(np.int64))


@pytest.mark.asyncio
async def test_a_large_update_is_encrypted_on_worker_processes_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    secret, public = _keys()
    ctx = he.load_public_context(public, PARAMS, PARAMS.context_max_bytes(secret=False))
    quantized = (
        np.random.default_rng(1)
        .integers(0, 256, size=he.POOL_MIN_CHUNKS * PARAMS.slots + 3)
        .astype(np.uint32)
    )
    loop_thread, seen = threading.get_ident(), []
    real = he._encrypt_in_pool

    def spy(public_ctx: he.PublicContext, x: np.ndarray, workers: int) -> list[bytes]:
        seen.append((workers, threading.get_ident()))
        return real(public_ctx, x, workers)

    monkeypatch.setattr(he, "_encrypt_in_pool", spy)
    monkeypatch.setattr(he, "available_cpus", lambda: 2)
    body = await encrypt_update(ctx, quantized)
    assert len(seen) == 1 and seen[0][0] == 2 and seen[0][1] != loop_thread
    chunks = he.unframe_chunks(body, PARAMS, quantized.size)
    key = he.load_secret_context(secret, PARAMS, PARAMS.context_max_bytes(secret=True))
    values = he.decrypt_sum(key, chunks, quantized.size)
    np.testing.assert_array_equal(np.rint(values).astype(np.int64), quantized.astype(np.int64))


@pytest.mark.asyncio
async def test_the_agent_encrypts_on_every_cpu_it_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    _, public = _keys()
    ctx = he.load_public_context(public, PARAMS, PARAMS.context_max_bytes(secret=False))
    asked: list[int] = []

    def fake_encrypt(
        context: he.PublicContext, values: np.ndarray, workers: int = 1
    ) -> list[bytes]:
        asked.append(workers)
        return [b"c"]

    monkeypatch.setattr(he, "encrypt", fake_encrypt)
    monkeypatch.setattr(he, "available_cpus", lambda: 7)
    big = np.zeros(he.POOL_MIN_CHUNKS * PARAMS.slots, dtype=np.uint32)
    await encrypt_update(ctx, big)
    await encrypt_update(ctx, big, workers=3)
    await encrypt_update(ctx, np.zeros(10, dtype=np.uint32))  # inline: never a pool
    assert asked == [7, 3, 1]
