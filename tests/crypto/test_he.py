"""CKKS sum-only encryption: exact sums, order-independent digests, refused contexts and
ciphertexts (each refusal leaves the running sum as it was)."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import tenseal as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import he
from fedsec.crypto.errors import CryptoError, PayloadError

PARAMS = he.HeParams()  # N = 8192, [60, 60], 2^40
SMALL = he.HeParams(4096, (60, 49), 40)
DIM = PARAMS.slots + 100  # one full chunk and a partial one


class Keys:
    def __init__(self, params: he.HeParams) -> None:
        self.params = params
        self.secret_bytes, self.public_bytes = he.generate_keys(params)
        self.public = he.load_public_context(
            self.public_bytes, params, params.context_max_bytes(secret=False)
        )
        self.secret = he.load_secret_context(
            self.secret_bytes, params, params.context_max_bytes(secret=True)
        )


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys(PARAMS)


@pytest.fixture(scope="module")
def small_keys() -> Keys:
    return Keys(SMALL)


def _updates(n: int, dim: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """n clipped updates (|x| <= 1), weighted by weights summing to 1, and their sum."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(n))
    xs = [w * rng.uniform(-1.0, 1.0, dim) for w in weights]
    return xs, np.sum(xs, axis=0)


def _summed(keys: Keys, contributions: list[list[bytes]], dim: int) -> he.CiphertextSum:
    total = he.CiphertextSum(keys.public, keys.params, dim)
    for chunks in contributions:
        total.add(chunks)
    return total


# -- round trip and sums -----------------------------------------------------------------------


def test_round_trip(keys: Keys) -> None:
    x = np.random.default_rng(1).uniform(-1.0, 1.0, DIM)
    chunks = he.encrypt(keys.public, x)
    assert len(chunks) == PARAMS.chunks(DIM) == 2
    assert all(len(c) <= PARAMS.ciphertext_max_bytes for c in chunks)
    total = _summed(keys, [chunks], DIM)
    out = he.decrypt_sum(keys.secret, total.serialize(), DIM)
    assert out.dtype == np.float64 and out.shape == (DIM,)
    assert np.max(np.abs(out - x)) < 1e-6


@pytest.mark.parametrize("which", ["default", "small"])
def test_sum_of_ten_weighted_updates_equals_the_plaintext_sum(
    which: str, keys: Keys, small_keys: Keys
) -> None:
    k = keys if which == "default" else small_keys
    dim = 2 * k.params.slots + 7
    xs, expected = _updates(10, dim, seed=2)
    total = _summed(k, [he.encrypt(k.public, x) for x in xs], dim)
    assert total.count == 10
    out = he.decrypt_sum(k.secret, total.serialize(), dim)
    assert np.max(np.abs(out - expected)) < 1e-6


def test_digest_is_independent_of_the_order_of_contributions(keys: Keys) -> None:
    xs, _ = _updates(4, DIM, seed=3)
    contributions = [he.encrypt(keys.public, x) for x in xs]
    forward = _summed(keys, contributions, DIM)
    backward = _summed(keys, contributions[::-1], DIM)
    shuffled = _summed(keys, [contributions[i] for i in (2, 0, 3, 1)], DIM)
    assert forward.serialize() == backward.serialize() == shuffled.serialize()
    assert forward.digest() == backward.digest() == shuffled.digest()
    assert forward.digest() == he.sum_digest(forward.serialize())
    assert forward.digest() != _summed(keys, contributions[:3], DIM).digest()


def test_a_members_protobuf_scale_field_does_not_make_the_digest_order_dependent(
    keys: Keys,
) -> None:
    """TenSEAL's protobuf carries a ``scale`` field besides the ciphertext's own; a member
    may set it to anything.  The sum's fields are the aggregator's, so order never shows."""
    xs, _ = _updates(2, DIM, seed=4)
    honest, other = (he.encrypt(keys.public, x) for x in xs)
    scale_field = b"\x19" + struct.pack("<d", PARAMS.scale)
    assert all(c.endswith(scale_field) for c in honest)
    odd = [c[:-8] + struct.pack("<d", 1.0) for c in honest]
    assert _summed(keys, [odd, other], DIM).digest() == _summed(keys, [other, odd], DIM).digest()
    assert _summed(keys, [odd, other], DIM).digest() == _summed(keys, [honest, other], DIM).digest()


@settings(max_examples=12, deadline=None)
@given(
    dim=st.integers(min_value=1, max_value=3 * SMALL.slots),
    members=st.integers(min_value=1, max_value=4),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_property_sum_is_exact_to_1e6_and_order_free(dim: int, members: int, seed: int) -> None:
    k = _SMALL_KEYS
    xs, expected = _updates(members, dim, seed)
    contributions = [he.encrypt(k.public, x) for x in xs]
    total = _summed(k, contributions, dim)
    assert np.max(np.abs(he.decrypt_sum(k.secret, total.serialize(), dim) - expected)) < 1e-6
    order = np.random.default_rng(seed).permutation(members)
    assert _summed(k, [contributions[i] for i in order], dim).digest() == total.digest()


_SMALL_KEYS = Keys(SMALL)


# -- contexts ----------------------------------------------------------------------------------


def test_public_context_holds_no_secret_key_and_cannot_decrypt(keys: Keys) -> None:
    ctx = keys.public.context
    assert not ctx.is_private() and not ctx.has_secret_key()
    assert not ctx.has_relin_keys() and not ctx.has_galois_keys()  # additions need neither
    chunk = he.encrypt(keys.public, np.ones(10))[0]
    with pytest.raises(ValueError, match="secret"):
        ts.ckks_vector_from(ctx, chunk).decrypt()
    with pytest.raises(CryptoError, match="no secret key"):
        he.load_secret_context(keys.public_bytes, PARAMS, PARAMS.context_max_bytes(secret=True))


def test_a_context_holding_a_secret_key_is_refused_as_a_public_one(keys: Keys) -> None:
    with pytest.raises(CryptoError, match="holds a secret key"):
        he.load_public_context(keys.secret_bytes, PARAMS, PARAMS.context_max_bytes(secret=True))


def test_context_bytes_are_size_checked_before_parsing(keys: Keys) -> None:
    limit = PARAMS.context_max_bytes(secret=False)
    assert len(keys.public_bytes) <= limit
    with pytest.raises(PayloadError, match="more than"):
        he.load_public_context(keys.public_bytes, PARAMS, len(keys.public_bytes) - 1)
    with pytest.raises(PayloadError, match="more than"):
        he.load_public_context(b"\x00" * (limit + 1), PARAMS, limit)
    with pytest.raises(CryptoError, match="does not parse"):
        he.load_public_context(b"\x00garbage" * 10, PARAMS, limit)


def test_a_context_with_other_parameters_or_scale_is_refused(keys: Keys) -> None:
    other = he.HeParams(8192, (50, 60), 40)
    _, other_public = he.generate_keys(other)
    with pytest.raises(CryptoError, match="not the federation's"):
        he.load_public_context(other_public, PARAMS, PARAMS.context_max_bytes(secret=False))
    ctx = ts.context_from(keys.public_bytes)
    ctx.global_scale = 2.0**30
    with pytest.raises(CryptoError, match="scale"):
        he.load_public_context(ctx.serialize(), PARAMS, PARAMS.context_max_bytes(secret=False))


# -- refused contributions ---------------------------------------------------------------------


@pytest.fixture
def running(keys: Keys) -> tuple[he.CiphertextSum, str, list[bytes]]:
    """A sum holding one contribution, its digest, and a second valid contribution."""
    xs, _ = _updates(2, DIM, seed=5)
    total = _summed(keys, [he.encrypt(keys.public, xs[0])], DIM)
    return total, total.digest(), he.encrypt(keys.public, xs[1])


def _assert_refused(
    total: he.CiphertextSum, before: str, chunks: list[bytes], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        total.add(chunks)
    assert total.count == 1
    assert total.digest() == before


def test_add_and_decrypt_adds_like_add_and_opens_the_contribution_alone(keys: Keys) -> None:
    xs, _ = _updates(2, DIM, seed=6)
    first, second = (he.encrypt(keys.public, x) for x in xs)
    total, alike = _summed(keys, [first], DIM), _summed(keys, [first, second], DIM)
    values = total.add_and_decrypt(second, keys.secret)
    assert total.count == 2 and total.digest() == alike.digest()
    assert values.shape == (DIM,) and np.max(np.abs(values - xs[1])) < 1e-6
    # a refused contribution changes nothing, as with add
    with pytest.raises(PayloadError, match="got 1"):
        total.add_and_decrypt(second[:1], keys.secret)
    with pytest.raises(CryptoError, match="chunk 1"):
        total.add_and_decrypt([second[0], b"\x00" * 100], keys.secret)
    with pytest.raises(CryptoError, match="parameters differ"):
        total.add_and_decrypt(second, _SMALL_KEYS.secret)
    assert total.count == 2 and total.digest() == alike.digest()


def test_wrong_chunk_count_is_refused(running: tuple[he.CiphertextSum, str, list[bytes]]) -> None:
    total, before, good = running
    _assert_refused(total, before, good[:1], PayloadError, "2 ciphertexts.*got 1")
    _assert_refused(total, before, [*good, good[0]], PayloadError, "got 3")


def test_oversized_or_non_bytes_chunk_is_refused_before_parsing(
    running: tuple[he.CiphertextSum, str, list[bytes]],
) -> None:
    total, before, good = running
    padded = [good[0], good[1] + b"\x00" * PARAMS.ciphertext_max_bytes]
    _assert_refused(total, before, padded, PayloadError, "chunk 1 is .* bytes")
    _assert_refused(total, before, [good[0], bytearray(good[1])], PayloadError, "chunk 1 must")


def test_garbage_chunk_is_refused_and_nothing_is_added(
    running: tuple[he.CiphertextSum, str, list[bytes]],
) -> None:
    total, before, good = running
    for junk in (b"", b"\x00" * 100, good[1][: len(good[1]) // 2], bytes(len(good[1]))):
        _assert_refused(total, before, [good[0], junk], CryptoError, "chunk 1")


def test_ciphertext_under_other_parameters_is_refused(
    running: tuple[he.CiphertextSum, str, list[bytes]],
) -> None:
    total, before, good = running
    other = he.HeParams(8192, (50, 60), 40)  # same byte size, other primes
    _, public = he.generate_keys(other)
    foreign = he.encrypt(
        he.load_public_context(public, other, other.context_max_bytes(False)), np.ones(DIM)
    )
    _assert_refused(total, before, [good[0], foreign[1]], CryptoError, "chunk 1 does not deser")


def test_ciphertext_of_wrong_scale_values_or_polynomials_is_refused(
    keys: Keys, running: tuple[he.CiphertextSum, str, list[bytes]]
) -> None:
    total, before, good = running
    ctx = keys.public.context
    rest = [0.5] * (DIM - PARAMS.slots)
    low_scale = ts.ckks_vector(ctx, rest, scale=2.0**30).serialize()
    _assert_refused(total, before, [good[0], low_scale], CryptoError, "chunk 1 has scale")
    short = ts.ckks_vector(ctx, rest[:10]).serialize()
    _assert_refused(total, before, [good[0], short], CryptoError, "chunk 1 holds 10 values")
    squared_ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 60])
    squared_ctx.auto_relin = False
    squared_ctx.auto_rescale = False
    vec = ts.ckks_vector(squared_ctx, rest, scale=2.0**20)
    squared = (vec * vec).serialize()  # 3 polynomials at scale 2^40: over the size bound
    _assert_refused(total, before, [good[0], squared], PayloadError, "chunk 1 is")
    total.add(good)  # the sum still takes a valid contribution
    assert total.count == 2


def test_ciphertext_under_other_keys_is_indistinguishable_to_the_aggregator(
    keys: Keys,
) -> None:
    """A known limit, pinned here so nobody relies on the opposite: under RLWE a ciphertext
    under other keys of the same parameters passes every check the aggregator can make, and
    only the custodian's decryption shows the damage.  Accountability comes from the
    member's signature over its ciphertext hash, not from this layer."""
    other = Keys(PARAMS)
    xs, expected = _updates(2, DIM, seed=6)
    total = _summed(keys, [he.encrypt(keys.public, xs[0]), he.encrypt(other.public, xs[1])], DIM)
    out = he.decrypt_sum(keys.secret, total.serialize(), DIM)
    assert np.max(np.abs(out - expected)) > 1.0


def test_decrypt_sum_checks_count_and_size(keys: Keys) -> None:
    chunks = _summed(keys, [he.encrypt(keys.public, np.zeros(DIM))], DIM).serialize()
    with pytest.raises(PayloadError, match="got 1"):
        he.decrypt_sum(keys.secret, chunks[:1], DIM)
    with pytest.raises(PayloadError, match="chunk 0 is"):
        he.decrypt_sum(
            keys.secret, [chunks[0] + bytes(PARAMS.ciphertext_max_bytes), chunks[1]], DIM
        )


def test_empty_sum_has_no_serialisation(keys: Keys) -> None:
    total = he.CiphertextSum(keys.public, PARAMS, DIM)
    assert total.count == 0
    with pytest.raises(CryptoError, match="no contribution"):
        total.digest()
    with pytest.raises(CryptoError, match="differ"):
        he.CiphertextSum(keys.public, SMALL, DIM)


# -- parameters and inputs ---------------------------------------------------------------------


def test_default_parameters() -> None:
    assert PARAMS.slots == 4096 and SMALL.slots == 2048
    assert PARAMS.chunks(1_000_000) == 245
    assert PARAMS.data_bits == 60 and PARAMS.headroom == 2.0**18
    # 2 polys x 8192 x one data prime x 8 bytes, plus margin
    assert 131_072 < PARAMS.ciphertext_max_bytes < 133_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"poly_modulus_degree": 2048}, "must be one of"),
        ({"poly_modulus_degree": 5000}, "must be one of"),
        ({"coeff_mod_bit_sizes": (60, 60, 60, 60)}, "secure only up to 218"),
        ({"poly_modulus_degree": 4096, "coeff_mod_bit_sizes": (60, 50)}, "up to 109"),
        ({"coeff_mod_bit_sizes": (61, 60)}, "2..60 bits"),
        ({"coeff_mod_bit_sizes": ()}, "non-empty tuple"),
        ({"coeff_mod_bit_sizes": [60, 60]}, "non-empty tuple"),
        ({"scale_bits": 10}, "scale must be"),
        ({"scale_bits": 59}, "scale must be"),
        ({"scale_bits": 59, "coeff_mod_bit_sizes": (60, 60)}, "scale must be"),
        ({"scale_bits": 50, "coeff_mod_bit_sizes": (50, 60)}, "no headroom"),
        ({"coeff_mod_bit_sizes": (30, 3), "scale_bits": 20}, "SEAL refused"),
    ],
)
def test_invalid_parameters_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(CryptoError, match=match):
        he.HeParams(**kwargs)  # type: ignore[arg-type]


def test_encrypt_refuses_what_ckks_cannot_hold(keys: Keys) -> None:
    with pytest.raises(CryptoError, match="empty"):
        he.encrypt(keys.public, np.zeros(0))
    with pytest.raises(CryptoError, match="NaN"):
        he.encrypt(keys.public, np.array([1.0, np.nan]))
    with pytest.raises(CryptoError, match="holds"):
        he.encrypt(keys.public, np.array([PARAMS.headroom]))


# -- encryption on several processes -----------------------------------------------------------


def _pool_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the worker count of every pooled encryption, and still run it."""
    calls: list[int] = []
    real = he._encrypt_in_pool

    def spy(public_ctx: he.PublicContext, x: np.ndarray, workers: int) -> list[bytes]:
        calls.append(workers)
        return real(public_ctx, x, workers)

    monkeypatch.setattr(he, "_encrypt_in_pool", spy)
    return calls


def test_pooled_encryption_decrypts_like_one_core_with_the_same_framing(
    keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    dim = he.POOL_MIN_CHUNKS * PARAMS.slots + 100  # a partial last chunk too
    x = np.random.default_rng(7).uniform(-1.0, 1.0, dim)
    one_core = he.encrypt(keys.public, x)
    pooled_in = _pool_spy(monkeypatch)
    pooled = he.encrypt(keys.public, x, workers=2)
    assert pooled_in == [2]
    assert len(pooled) == len(one_core) == PARAMS.chunks(dim) == he.POOL_MIN_CHUNKS + 1
    assert [len(c) for c in pooled] == [len(c) for c in one_core]
    assert len(he.frame_chunks(pooled)) == len(he.frame_chunks(one_core))
    assert pooled != one_core  # fresh randomness, not a copy
    # chunk order: each decrypts to its own slice (a swap would be off by ~1)
    out = he.decrypt_sum(keys.secret, pooled, dim)
    assert np.max(np.abs(out - x)) < 1e-6
    assert np.max(np.abs(out - he.decrypt_sum(keys.secret, one_core, dim))) < 1e-6
    # and the aggregator admits them as it admits one-core chunks
    total = _summed(keys, [pooled, one_core], dim)
    assert np.max(np.abs(he.decrypt_sum(keys.secret, total.serialize(), dim) - 2 * x)) < 1e-6


def test_more_workers_than_tasks_still_encrypts_every_chunk_in_order(
    small_keys: Keys,
) -> None:
    dim = he.POOL_MIN_CHUNKS * SMALL.slots
    x = np.linspace(-1.0, 1.0, dim)
    chunks = he.encrypt(small_keys.public, x, workers=3 * he.POOL_MIN_CHUNKS)
    assert len(chunks) == SMALL.chunks(dim)
    assert np.max(np.abs(he.decrypt_sum(small_keys.secret, chunks, dim) - x)) < 1e-6


@pytest.mark.parametrize(
    ("chunks", "workers", "pooled"),
    [
        (1, 16, False),
        (2, 16, False),
        (he.POOL_MIN_CHUNKS - 1, 2, False),
        (he.POOL_MIN_CHUNKS, 1, False),
        (he.POOL_MIN_CHUNKS, 2, True),
    ],
)
def test_only_updates_of_pool_min_chunks_or_more_start_a_pool(
    small_keys: Keys, monkeypatch: pytest.MonkeyPatch, chunks: int, workers: int, pooled: bool
) -> None:
    calls: list[int] = []

    def fake_pool(public_ctx: he.PublicContext, x: np.ndarray, n: int) -> list[bytes]:
        calls.append(n)
        return [b"pooled"]

    monkeypatch.setattr(he, "_encrypt_in_pool", fake_pool)
    out = he.encrypt(small_keys.public, np.full(chunks * SMALL.slots, 0.5), workers)
    if pooled:
        assert calls == [workers] and out == [b"pooled"]
    else:
        assert calls == [] and len(out) == chunks


def test_a_daemonic_process_encrypts_in_process(
    small_keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    class Daemon:
        daemon = True

    calls = _pool_spy(monkeypatch)
    monkeypatch.setattr(multiprocessing, "current_process", Daemon)
    x = np.full(he.POOL_MIN_CHUNKS * SMALL.slots, 0.5)
    assert len(he.encrypt(small_keys.public, x, workers=2)) == he.POOL_MIN_CHUNKS
    assert calls == []


@pytest.mark.parametrize("workers", [0, -1, True, 1.5, "2", None])
def test_workers_must_be_a_positive_integer(
    small_keys: Keys, monkeypatch: pytest.MonkeyPatch, workers: object
) -> None:
    calls = _pool_spy(monkeypatch)
    x = np.full(he.POOL_MIN_CHUNKS * SMALL.slots, 0.5)
    with pytest.raises(CryptoError, match="workers must be an integer >= 1"):
        he.encrypt(small_keys.public, x, workers)  # type: ignore[arg-type]
    assert calls == []


def test_a_worker_that_cannot_load_the_context_fails_the_call_and_leaves_no_process(
    keys: Keys, small_keys: Keys
) -> None:
    import multiprocessing

    # N = 8192 keys labelled with N = 4096 parameters: each worker's load_public_context
    # refuses them (too large for N = 4096), and each task fails with that reason
    mislabelled = he.PublicContext(SMALL, keys.public.context)
    x = np.full(he.POOL_MIN_CHUNKS * SMALL.slots, 0.5)
    with pytest.raises(
        CryptoError,
        match=r"could not load the public context: the public CKKS context is \d+ bytes",
    ):
        he.encrypt(mislabelled, x, workers=2)
    assert multiprocessing.active_children() == []
    # the next pool starts afresh
    assert len(he.encrypt(small_keys.public, x, workers=2)) == he.POOL_MIN_CHUNKS


def _until(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {within_s:.0f} s")
        time.sleep(0.001)


class _FirstWorkerDiesWhileTheSecondStarts(ProcessPoolExecutor):
    """The interleaving CI met once under load, forced: the first worker dies, and
    CPython's executor thread marks the pool broken and closes the workers' queue, while
    ``submit`` (past its broken check) is starting the second worker.  Reaches into
    CPython 3.11's executor internals, the only way to order two of its threads."""

    def _spawn_process(self) -> None:
        processes = self._processes
        if processes:
            first = next(iter(processes.values()))
            first.kill()
            first.join(30)
            reader = self._call_queue._reader  # type: ignore[attr-defined]
            _until(lambda: reader.closed, "the executor thread closing the broken pool")
        super()._spawn_process()  # type: ignore[misc]


def test_a_worker_dying_while_the_pool_starts_fails_the_call_and_leaves_no_process(
    small_keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    internals = ("_spawn_process", "_processes", "_call_queue")
    if not all(hasattr(ProcessPoolExecutor(1), name) for name in internals):
        pytest.skip("this Python's ProcessPoolExecutor starts its workers another way")
    x = np.full(he.POOL_MIN_CHUNKS * SMALL.slots, 0.5)
    monkeypatch.setattr(he, "ProcessPoolExecutor", _FirstWorkerDiesWhileTheSecondStarts)
    with pytest.raises(CryptoError, match=r"encryption worker process died: .*handle is closed"):
        he.encrypt(small_keys.public, x, workers=2)
    assert multiprocessing.active_children() == []
    monkeypatch.undo()
    assert len(he.encrypt(small_keys.public, x, workers=2)) == he.POOL_MIN_CHUNKS


def test_available_cpus_is_the_affinity_mask_else_the_cpu_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    if hasattr(os, "sched_getaffinity"):
        assert he.available_cpus() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    assert he.available_cpus() == (os.cpu_count() or 1)
