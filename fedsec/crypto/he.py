"""CKKS sum-only encryption (TenSEAL over Microsoft SEAL): members encrypt, the aggregator
adds ciphertexts it cannot open, a key custodian decrypts the aggregate.

Roles and what each holds:

- the **key custodian** runs :func:`generate_keys` and keeps the secret context;
- **members** and the **aggregator** hold only the public context
  (:func:`load_public_context` refuses one that carries a secret key);
- a member :func:`encrypt`\\ s its clipped, weighted update in chunks of ``slots`` values,
  on as many worker processes as it may use (TenSEAL holds the GIL, so threads cannot);
- the aggregator streams contributions into a :class:`CiphertextSum` (memory O(d));
- the custodian :func:`decrypt_sum`\\ s the aggregate.

Sum-only: members pre-weight in plaintext and the division happens after decryption, so
the only homomorphic operation is addition.  Additions need no evaluation keys (relin keys
serve multiplications, Galois keys rotations), so the public context carries the public
key alone, and no rescaling level is needed: with coefficient moduli ``[q0, p]`` the
ciphertexts live at the single data prime ``q0`` (SEAL keeps the last prime ``p`` as the
"special prime" of key switching, which never appears in a ciphertext).

Ciphertext addition is exact modular polynomial addition, so the sum of the same
contributions is the same ciphertext in any order, and :meth:`CiphertextSum.digest` (a
hash of its canonical serialisation) is order-independent.  Canonical means: TenSEAL's
serialisation (a protobuf holding SEAL's ``Ciphertext::save`` with SEAL's default zstd
compression, deterministic for one TenSEAL build; the API offers no other compression
mode), and a running sum whose protobuf fields (value count, the ``scale`` field) come
from the aggregator's own vectors, never from a member's bytes, which could carry any
``scale`` field without changing the ciphertext.  Digests are comparable between parties
running the same TenSEAL version; record it beside the digest.

What the aggregator cannot check: under RLWE a ciphertext made with other keys of the
same parameters is indistinguishable from an honest one, so it deserialises, passes every
check here and corrupts the decrypted aggregate.  The defence lies outside this module (the
member signs the ciphertext's hash in its contribution statement, so a corrupt aggregate
can be traced to its contributors); likewise nothing here bounds a member's plaintext.

Limits: every byte string that comes over a network is size-checked before TenSEAL parses
it (:meth:`HeParams.ciphertext_max_bytes`, :meth:`HeParams.context_max_bytes`), and a
contribution's chunk count is checked before any chunk is parsed.  SEAL's own loader
checks a ciphertext's metadata against the context while it inflates, so a zstd bomb
inside an admitted chunk fails before it allocates (measured with TenSEAL 0.3.18: a
64 KB chunk declaring 2 GB of zstd RLE blocks is refused in 0.2 s with 1 MB of memory).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import sys
import types
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import numpy.typing as npt
import tenseal as ts

from fedsec.crypto.errors import CryptoError, PayloadError

__all__ = [
    "POOL_MIN_CHUNKS",
    "CiphertextSum",
    "HeParams",
    "PublicContext",
    "SecretContext",
    "available_cpus",
    "decrypt_sum",
    "encrypt",
    "frame_chunks",
    "generate_keys",
    "load_public_context",
    "load_secret_context",
    "sum_digest",
    "unframe_chunks",
]

# The largest total coefficient-modulus bit count SEAL accepts at 128-bit classical security
# for each polynomial degree: ``seal::CoeffModulus::MaxBitCount(N, sec_level_type::tc128)``,
# the ``SEAL_HE_STD_PARMS_128_TC`` table of native/src/seal/util/hestdparms.h, taken from the
# HomomorphicEncryption.org security standard (Albrecht et al., 2018).  SEAL refuses larger
# moduli itself; checking here gives the sentence.  4096 is the smallest degree whose slots
# (2048) keep the per-ciphertext overhead negligible; 16384 the largest worth a sum-only use.
MAX_COEFF_MODULUS_BITS = {4096: 109, 8192: 218, 16384: 438}
# SEAL_USER_MOD_BIT_COUNT_MIN/MAX: the prime sizes ``CoeffModulus::Create`` can produce.
MIN_PRIME_BITS, MAX_PRIME_BITS = 2, 60
# A fresh ciphertext's noise is ~2^15 in coefficient units (measured: 4e-8 error at 2^40 for
# a sum of 10), so below 2^20 one update's error passes 1e-2; a clipped update needs far
# better.  The upper end leaves the 60-bit data prime room for the sum.
MIN_SCALE_BITS, MAX_SCALE_BITS = 20, 58
# One sign bit and one bit of margin between the scaled sum and the data modulus.
_HEADROOM_BITS = 2
# A fresh CKKS ciphertext is two polynomials (c0, c1); more appear only after a multiplication.
_FRESH_POLYS = 2
# Serialisation overhead over the raw coefficients of one ciphertext: zstd's worst case
# (ZSTD_COMPRESSBOUND: n + n/256 for n >= 128 KiB, raw blocks when data does not compress),
# SEAL's 16-byte header and ~70 bytes of ciphertext metadata, TenSEAL's protobuf fields
# (measured total at N = 8192 [60, 60]: 145 bytes over the 131072 raw ones).
_ZSTD_BOUND_DIVISOR = 256
_FIXED_MARGIN_BYTES = 512
# Domain separation of the sum digest from any other hash of the same bytes.
_DIGEST_DOMAIN = b"fedsec/v1/he-sum\x00"
# pybind11 turns SEAL's and TenSEAL's C++ exceptions into these.
_NATIVE_ERRORS = (ValueError, RuntimeError, TypeError, IndexError, OverflowError)
# Encryption on several cores.  Below this many chunks one core is faster: a pool of two
# workers forked from a running forkserver costs ~45 ms before its first ciphertext (start,
# context load, teardown; measured with TenSEAL 0.3.18 at N = 8192, 3.9 ms per chunk), which
# two workers win back only past ~25 chunks.  The first pool of a process also starts the
# forkserver, once (see _worker_processes).
POOL_MIN_CHUNKS = 32
# Chunks per task handed to a worker: 8 make 256 KiB of values in and ~1 MiB of ciphertexts
# out, so a task's ~0.3 ms of pickling and pipe is 1 % of its 31 ms of encryption; fewer
# when that leaves a worker fewer than _TASKS_PER_WORKER tasks to balance the load with.
_MAX_CHUNKS_PER_TASK = 8
_TASKS_PER_WORKER = 2
# Tasks submitted and not yet collected, per worker: two keep each worker busy while the
# caller collects a result, and bound what the pool holds beyond the output to
# 2 x workers x 8 chunks (the values of the rest are sliced only when submitted).
_TASKS_IN_FLIGHT_PER_WORKER = 2

FloatVector = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class HeParams:
    """CKKS parameters of a federation: degree N, coefficient moduli bit sizes, scale 2^s."""

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 60)
    scale_bits: int = 40

    def __post_init__(self) -> None:
        """Raises:
        CryptoError: a degree outside {4096, 8192, 16384}, a modulus beyond 128-bit
            security or SEAL's prime sizes, or a scale that leaves the sum no headroom.
        """
        n, bits = self.poly_modulus_degree, self.coeff_mod_bit_sizes
        if n not in MAX_COEFF_MODULUS_BITS:
            raise CryptoError(
                f"CKKS poly modulus degree must be one of {sorted(MAX_COEFF_MODULUS_BITS)}, got {n}"
            )
        if not (isinstance(bits, tuple) and bits and all(isinstance(b, int) for b in bits)):
            raise CryptoError(
                f"coefficient modulus bit sizes must be a non-empty tuple of ints, got {bits!r}"
            )
        if not all(MIN_PRIME_BITS <= b <= MAX_PRIME_BITS for b in bits):
            raise CryptoError(
                f"each coefficient modulus prime must have {MIN_PRIME_BITS}..{MAX_PRIME_BITS} "
                f"bits (SEAL's limits), got {list(bits)}"
            )
        if sum(bits) > MAX_COEFF_MODULUS_BITS[n]:
            raise CryptoError(
                f"coefficient moduli {list(bits)} total {sum(bits)} bits; N = {n} is 128-bit "
                f"secure only up to {MAX_COEFF_MODULUS_BITS[n]} bits"
            )
        if not MIN_SCALE_BITS <= self.scale_bits <= MAX_SCALE_BITS:
            raise CryptoError(
                f"scale must be 2^{MIN_SCALE_BITS}..2^{MAX_SCALE_BITS}, got 2^{self.scale_bits}"
            )
        if self.scale_bits > self.data_bits - _HEADROOM_BITS:
            raise CryptoError(
                f"scale 2^{self.scale_bits} leaves no headroom in the {self.data_bits}-bit data "
                f"modulus; use a scale of at most 2^{self.data_bits - _HEADROOM_BITS}"
            )
        _reference_ids(self)  # SEAL's prime search: some small sizes have too few primes

    @property
    def slots(self) -> int:
        """Values per ciphertext: N/2."""
        return self.poly_modulus_degree // 2

    @property
    def scale(self) -> float:
        return float(2**self.scale_bits)

    @property
    def data_primes(self) -> int:
        """Primes a ciphertext carries: all but SEAL's special prime (the only one if alone)."""
        return max(1, len(self.coeff_mod_bit_sizes) - 1)

    @property
    def data_bits(self) -> int:
        return sum(self.coeff_mod_bit_sizes[: self.data_primes])

    @property
    def headroom(self) -> float:
        """Largest |Σ wᵢxᵢ| per coordinate that decrypts correctly: 2^(data bits - scale - 2)."""
        return float(2 ** (self.data_bits - self.scale_bits - _HEADROOM_BITS))

    def chunks(self, dim: int) -> int:
        """Ciphertexts of a ``dim``-value vector: ceil(dim / slots)."""
        return -(-dim // self.slots)

    @property
    def ciphertext_max_bytes(self) -> int:
        """Largest serialised chunk admitted: 2 polys x N x data primes x 8 bytes, plus
        zstd's worst-case expansion and SEAL's and TenSEAL's headers."""
        raw = _FRESH_POLYS * self.poly_modulus_degree * self.data_primes * 8
        return raw + raw // _ZSTD_BOUND_DIVISOR + _FIXED_MARGIN_BYTES

    def context_max_bytes(self, secret: bool) -> int:
        """Largest serialised context admitted: the public key (2 polys x N x all primes x 8
        bytes), plus the secret key (1 poly) for the custodian's context, plus margins."""
        raw = (3 if secret else 2) * self.poly_modulus_degree * len(self.coeff_mod_bit_sizes) * 8
        return raw + raw // _ZSTD_BOUND_DIVISOR + 2 * _FIXED_MARGIN_BYTES


@lru_cache(maxsize=16)
def _reference_ids(params: HeParams) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key-level, first data-level) SEAL parms_id of ``params``: hashes of the encryption
    parameters alone, the same for any keys, so a context or ciphertext made with other
    parameters is recognised by its id."""
    seal = _new_context(params).data.seal_context()
    return tuple(seal.key_parms_id()), tuple(seal.first_parms_id())


def _new_context(params: HeParams) -> Any:
    try:
        ctx = ts.context(
            ts.SCHEME_TYPE.CKKS,
            params.poly_modulus_degree,
            coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
            n_threads=1,  # one chunk per vector: TenSEAL's thread pool would idle
        )
    except _NATIVE_ERRORS as exc:
        raise CryptoError(
            f"SEAL refused CKKS parameters N = {params.poly_modulus_degree}, "
            f"moduli {list(params.coeff_mod_bit_sizes)}: {exc}"
        ) from None
    ctx.global_scale = params.scale
    return ctx


@dataclass(frozen=True, slots=True)
class PublicContext:
    """A federation's public CKKS context: encrypts and adds, holds no secret key."""

    params: HeParams
    context: Any  # tenseal.Context, checked by load_public_context


@dataclass(frozen=True, slots=True)
class SecretContext:
    """The key custodian's context: holds the secret key."""

    params: HeParams
    context: Any  # tenseal.Context, checked by load_secret_context


def generate_keys(params: HeParams) -> tuple[bytes, bytes]:
    """A fresh key pair for a federation (the key custodian's side).

    Returns:
        (secret context bytes, public context bytes).  Neither holds relin or Galois keys
        (additions need none); the public one holds no secret key.

    Raises:
        CryptoError: SEAL refused the parameters (not expected for validated ``params``).
    """
    ctx = _new_context(params)
    secret = ctx.serialize(
        save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
    )
    public = _public_bytes(ctx)
    if ts.context_from(public, n_threads=1).is_private():
        raise AssertionError("TenSEAL serialised a secret key into the public context")
    return bytes(secret), public


def _public_bytes(ctx: Any) -> bytes:
    """A context's public half: the public key only (no secret, relin or Galois keys)."""
    return bytes(
        ctx.serialize(
            save_public_key=True,
            save_secret_key=False,
            save_galois_keys=False,
            save_relin_keys=False,
        )
    )


def _parse_context(data: bytes, params: HeParams, max_bytes: int, what: str) -> Any:
    if not isinstance(data, bytes):
        raise PayloadError(f"the {what} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PayloadError(f"the {what} is {len(data)} bytes, more than the {max_bytes} allowed")
    try:
        ctx = ts.context_from(data, n_threads=1)
    except _NATIVE_ERRORS as exc:
        raise CryptoError(f"the {what} does not parse as a TenSEAL context: {exc}") from None
    seal = ctx.data.seal_context()
    key_id, _ = _reference_ids(params)
    if tuple(seal.key_parms_id()) != key_id:
        key_data = seal.key_context_data()
        raise CryptoError(
            f"the {what} has CKKS parameters N = {key_data.parms().poly_modulus_degree()}, "
            f"{key_data.total_coeff_modulus_bit_count()}-bit modulus, not the federation's "
            f"N = {params.poly_modulus_degree}, moduli {list(params.coeff_mod_bit_sizes)}"
        )
    try:
        scale = float(ctx.global_scale)
    except ValueError:
        scale = 0.0
    if scale != params.scale:
        raise CryptoError(
            f"the {what} has scale {scale}, not the federation's 2^{params.scale_bits}"
        )
    return ctx


def load_public_context(data: bytes, params: HeParams, max_bytes: int) -> PublicContext:
    """A member's or the aggregator's context, from the custodian's published bytes.

    Args:
        data: serialised context (size-checked before parsing).
        params: the federation's CKKS parameters.
        max_bytes: largest size accepted; :meth:`HeParams.context_max_bytes` fits.

    Raises:
        PayloadError: ``data`` is larger than ``max_bytes``.
        CryptoError: it does not parse, holds a secret key (a member or the aggregator must
            never receive one), has no public key, or has other parameters or scale.
    """
    ctx = _parse_context(data, params, max_bytes, "public CKKS context")
    if ctx.is_private():
        raise CryptoError(
            "the public CKKS context holds a secret key; only the key custodian may hold it"
        )
    try:
        has_public_key = bool(ctx.has_public_key())
    except ValueError:  # symmetric contexts: encryption needs the secret key
        has_public_key = False
    if not has_public_key:
        raise CryptoError("the public CKKS context holds no public key to encrypt with")
    return PublicContext(params, ctx)


def load_secret_context(data: bytes, params: HeParams, max_bytes: int) -> SecretContext:
    """The key custodian's context, from its own stored bytes.

    Raises:
        PayloadError: ``data`` is larger than ``max_bytes``.
        CryptoError: it does not parse, holds no secret key, or has other parameters.
    """
    ctx = _parse_context(data, params, max_bytes, "secret CKKS context")
    if not ctx.is_private():
        raise CryptoError("the secret CKKS context holds no secret key")
    return SecretContext(params, ctx)


def encrypt(public_ctx: PublicContext, values: FloatVector, workers: int = 1) -> list[bytes]:
    """Encrypt a member's (already clipped and weighted) update, one chunk of ``slots``
    values at a time; each process keeps one chunk's ciphertext object alive at a time.

    Args:
        public_ctx: the federation's public context.
        values: the update.
        workers: processes to encrypt on.  1 encrypts in this process; more start a pool
            of worker processes (each loads the public context once) when the update has
            at least :data:`POOL_MIN_CHUNKS` chunks and this is not a daemonic process,
            and encrypt in this process otherwise.  Either way the output is the same
            list of chunks, in order.

    Returns:
        ceil(d / slots) serialised ciphertexts.

    Raises:
        CryptoError: ``workers`` is not a positive integer; ``values`` is empty, not
            finite, or exceeds the parameters' headroom; or a worker process could not
            load ``public_ctx``, could not start, or died.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise CryptoError(f"encryption workers must be an integer >= 1, got {workers!r}")
    params = public_ctx.params
    x = _checked_update(params, values)
    if (
        workers == 1
        or params.chunks(x.size) < POOL_MIN_CHUNKS
        or multiprocessing.current_process().daemon  # may start no child processes
    ):
        return _encrypt_chunks(public_ctx.context, x, params.slots)
    return _encrypt_in_pool(public_ctx, x, workers)


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (``taskset``, cgroup cpusets) where
    the system has one, else every CPU; the ``workers`` that uses them all."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return len(getaffinity(0))
    return os.cpu_count() or 1


def _checked_update(params: HeParams, values: FloatVector) -> FloatVector:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise CryptoError("cannot encrypt an empty vector")
    if not np.all(np.isfinite(x)):
        raise CryptoError("the update contains NaN or infinite values")
    peak = float(np.max(np.abs(x)))
    if peak >= params.headroom:
        raise CryptoError(
            f"update values reach {peak:g}; CKKS at scale 2^{params.scale_bits} holds "
            f"|value| < {params.headroom:g}"
        )
    return x


def _encrypt_chunks(context: Any, x: FloatVector, slots: int) -> list[bytes]:
    return [
        bytes(ts.ckks_vector(context, x[start : start + slots].tolist()).serialize())
        for start in range(0, x.size, slots)
    ]


def _encrypt_in_pool(public_ctx: PublicContext, x: FloatVector, workers: int) -> list[bytes]:
    """:func:`encrypt` on ``workers`` processes: tasks of consecutive chunks, submitted a
    bounded number ahead and collected in order, so the output is the one-core output."""
    params = public_ctx.params
    chunks = params.chunks(x.size)
    per_task = max(1, min(_MAX_CHUNKS_PER_TASK, chunks // (workers * _TASKS_PER_WORKER)))
    step = per_task * params.slots
    workers = min(workers, -(-chunks // per_task))
    public = _public_bytes(public_ctx.context)
    out: list[bytes] = []
    pending: deque[Future[list[bytes]]] = deque()
    try:
        with ProcessPoolExecutor(
            workers,
            mp_context=_worker_processes(),
            initializer=_start_worker,
            initargs=(public, params),
        ) as pool:  # shuts the pool down and waits for its processes on every path
            try:
                for start in range(0, x.size, step):
                    if len(pending) >= workers * _TASKS_IN_FLIGHT_PER_WORKER:
                        out += pending.popleft().result()
                    pending.append(_submit(pool, x[start : start + step]))
                while pending:
                    out += pending.popleft().result()
            finally:
                for future in pending:  # after an error: start none of the remaining tasks
                    future.cancel()
    except BrokenProcessPool as exc:
        raise CryptoError(f"an encryption worker process died: {exc}") from None
    return out


def _submit(pool: ProcessPoolExecutor, x: FloatVector) -> Future[list[bytes]]:
    """``pool.submit`` of one task, its failures to start a worker as a broken pool.

    Each submit may start a worker.  CPython's executor thread marks a pool broken when a
    worker dies (``terminate_broken``) without the lock ``submit`` holds, and closes the
    queue the workers read, so a submit that passed the broken check meanwhile fails on
    that queue: ``OSError: handle is closed`` while pickling it for the new worker, or
    ``RuntimeError`` (shut down) between the two flags (CPython 3.11 to 3.14).  Starting a
    worker can also fail on its own (``OSError``: no processes or descriptors left).
    """
    try:
        return pool.submit(_encrypt_task, x)
    except (OSError, RuntimeError) as exc:
        raise BrokenProcessPool(
            f"could not start an encryption worker ({type(exc).__name__}: {exc}); "
            "a worker process died or none could start"
        ) from None


@lru_cache(maxsize=1)
def _worker_processes() -> BaseContext:
    """How worker processes start: from the forkserver, a clean single-purpose process
    (never a fork of the caller, which may hold an event loop and threads), or spawned
    where there is none.

    The forkserver imports this module once, so a worker starts with TenSEAL loaded.  It
    also imports the modules the main script holds: every worker re-runs that script
    (Python 3.11's forkserver never preloads ``__main__``: CPython gh-98552, fixed by
    gh-126631), and under the ``fedsec`` command that re-run would otherwise import torch,
    opacus and scikit-learn again in each worker of each pool: 5.7 s and 400 MB apiece,
    six times what a d = 1M update takes on one core.  Preloaded, they are imported once,
    in the forkserver (which lives as long as this process), and shared copy-on-write;
    the first pool of a process waits for that.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__, *_main_script_imports()])
    return context


def _main_script_imports() -> list[str]:
    """The modules the main script's top-level names come from (``fedsec`` holds
    ``fedsec.cli``'s ``main``, pytest's runner ``_pytest.config``'s)."""
    main = sys.modules.get("__main__")
    found: set[str] = set()
    for value in vars(main).values() if main is not None else ():
        if isinstance(value, types.ModuleType):
            name: object = value.__name__
        else:  # a function's or class's own module, an instance's class's
            name = getattr(value, "__module__", None)
        if isinstance(name, str) and name in sys.modules and not name.startswith("__"):
            found.add(name)
    return sorted(found - {"builtins"})


# A worker process's public context, loaded once by _start_worker, or why it did not load.
_worker_context: PublicContext | None = None
_worker_context_refused: str | None = None


def _start_worker(public: bytes, params: HeParams) -> None:
    """Pool initializer: load the public context with :func:`load_public_context`'s checks.

    A refused context is kept as the reason each task then fails with, not raised: an
    initializer that raises ends its worker, which breaks the pool (every task fails
    with "terminated abruptly", the reason lost) and races the caller still starting the
    other workers (see :func:`_submit`).
    """
    global _worker_context, _worker_context_refused
    try:
        _worker_context = load_public_context(
            public, params, params.context_max_bytes(secret=False)
        )
    except (CryptoError, PayloadError) as exc:
        _worker_context_refused = str(exc)


def _encrypt_task(x: FloatVector) -> list[bytes]:
    if _worker_context_refused is not None:
        raise CryptoError(
            f"an encryption worker could not load the public context: {_worker_context_refused}"
        )
    if _worker_context is None:
        raise AssertionError("an encryption task ran in a process the pool did not start")
    return _encrypt_chunks(_worker_context.context, x, _worker_context.params.slots)


def sum_digest(chunks: Sequence[bytes]) -> str:
    """SHA-256 hex of a domain tag, the chunk count and each chunk length-prefixed."""
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(len(chunks).to_bytes(8, "big"))
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "big"))
        h.update(chunk)
    return h.hexdigest()


def _check_shape(chunks: Sequence[bytes], params: HeParams, dim: int) -> None:
    expected = params.chunks(dim)
    if len(chunks) != expected:
        raise PayloadError(
            f"a {dim}-value vector is {expected} ciphertexts at N = "
            f"{params.poly_modulus_degree}, got {len(chunks)}"
        )
    limit = params.ciphertext_max_bytes
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, bytes):
            raise PayloadError(f"ciphertext chunk {i} must be bytes, got {type(chunk).__name__}")
        if len(chunk) > limit:
            raise PayloadError(
                f"ciphertext chunk {i} is {len(chunk)} bytes, more than the {limit} a "
                f"ciphertext at these parameters can take"
            )


def _chunk_length(index: int, params: HeParams, dim: int) -> int:
    return min(params.slots, dim - index * params.slots)


def _load_chunk(ctx: Any, params: HeParams, dim: int, index: int, data: bytes) -> Any:
    """Deserialise chunk ``index`` under ``ctx`` and check it is one fresh ciphertext of the
    federation's first level and scale holding the expected number of values."""
    try:
        vec = ts.ckks_vector_from(ctx, data)
        cts = vec.ciphertext()
    except _NATIVE_ERRORS as exc:
        raise CryptoError(
            f"ciphertext chunk {index} does not deserialise under the federation's CKKS "
            f"context: {exc}"
        ) from None
    problem = _chunk_problem(vec, cts, params, _chunk_length(index, params, dim))
    if problem:
        raise CryptoError(f"ciphertext chunk {index} {problem}")
    return vec


def _chunk_problem(vec: Any, cts: list[Any], params: HeParams, length: int) -> str:
    if len(cts) != 1:
        return f"holds {len(cts)} ciphertexts, not 1"
    ct = cts[0]
    _, first_id = _reference_ids(params)
    if tuple(ct.parms_id()) != first_id:
        return "is not at the federation's first ciphertext level"
    if ct.size() != _FRESH_POLYS:
        return f"has {ct.size()} polynomials, a fresh ciphertext has {_FRESH_POLYS}"
    if not ct.is_ntt_form():
        return "is not in NTT form"
    if ct.scale != params.scale:
        return f"has scale {ct.scale}, not 2^{params.scale_bits}"
    if ct.is_transparent():
        return "is transparent (its second polynomial is zero: the values in the clear)"
    if vec.size() != length:
        return f"holds {vec.size()} values, not {length}"
    return ""


class CiphertextSum:
    """The aggregator's streaming sum of encrypted contributions (memory O(d)).

    Each accumulator starts as the aggregator's own encryption ``Z`` of zeros and holds
    ``Z + Σ contributions``; :meth:`serialize` subtracts ``Z`` back, which is exact, so the
    output is the plain modular sum with protobuf fields of the aggregator's own making
    (a sum of nothing would be a transparent ciphertext, which SEAL refuses to produce).
    """

    def __init__(self, public_ctx: PublicContext, params: HeParams, dim: int) -> None:
        """Raises:
        CryptoError: ``params`` are not the context's, or ``dim`` is not positive.
        """
        if params != public_ctx.params:
            raise CryptoError("the sum's CKKS parameters differ from the public context's")
        if dim < 1:
            raise CryptoError(f"the vector length must be positive, got {dim}")
        self._ctx = public_ctx.context
        self._params = params
        self._dim = dim
        lengths = [_chunk_length(i, params, dim) for i in range(params.chunks(dim))]
        zeros = {n: ts.ckks_vector(self._ctx, [0.0] * n) for n in set(lengths)}
        self._offsets = [zeros[n] for n in lengths]
        # Sharing Z is safe: sums are never updated in place.  (TenSEAL's ``copy()`` also
        # copies the context, 4.4 MB per vector at N = 8192: 1.1 GB for d = 1M.)
        self._sums = list(self._offsets)
        self._count = 0

    @property
    def count(self) -> int:
        """Contributions added."""
        return self._count

    def add(self, chunks: Sequence[bytes]) -> None:
        """Add one member's ciphertexts.  Every chunk is checked and deserialised before
        any is added, and the new sums replace the old only once all are computed, so a
        refused contribution changes nothing.

        Raises:
            PayloadError: wrong chunk count, or a chunk over the size bound (before parsing).
            CryptoError: a chunk does not deserialise under the federation's context, or has
                the wrong level, scale, polynomial count or value count (names the chunk).
        """
        _check_shape(chunks, self._params, self._dim)
        vectors = [
            _load_chunk(self._ctx, self._params, self._dim, i, data)
            for i, data in enumerate(chunks)
        ]
        try:
            sums = [acc + vec for acc, vec in zip(self._sums, vectors, strict=True)]
        except _NATIVE_ERRORS as exc:  # e.g. a chunk chosen to make the sum transparent
            raise CryptoError(f"the contribution cannot be added: {exc}") from None
        self._sums = sums
        self._count += 1

    def add_and_decrypt(self, chunks: Sequence[bytes], secret_ctx: SecretContext) -> FloatVector:
        """:meth:`add` one contribution and return its own values, decrypted under
        ``secret_ctx``: the key custodian's re-add, which also opens each contribution;
        each chunk is parsed once for both (a second parse costs a fifth of the decryption).

        Returns:
            The contribution's ``dim`` values as float64.

        Raises:
            CryptoError: ``secret_ctx`` has other parameters; see :meth:`add`.
            PayloadError: see :meth:`add`.
        """
        if secret_ctx.params != self._params:
            raise CryptoError("the secret context's CKKS parameters differ from the sum's")
        _check_shape(chunks, self._params, self._dim)
        vectors = [
            _load_chunk(self._ctx, self._params, self._dim, i, data)
            for i, data in enumerate(chunks)
        ]
        key = secret_ctx.context.secret_key()
        out = np.empty(self._dim, dtype=np.float64)
        try:
            sums = [acc + vec for acc, vec in zip(self._sums, vectors, strict=True)]
            for i, vec in enumerate(vectors):
                start = i * self._params.slots
                out[start : start + _chunk_length(i, self._params, self._dim)] = vec.decrypt(key)
        except _NATIVE_ERRORS as exc:
            raise CryptoError(f"the contribution cannot be added: {exc}") from None
        self._sums = sums
        self._count += 1
        return out

    def serialize(self) -> list[bytes]:
        """Canonical bytes of the sum, one per chunk.

        Raises:
            CryptoError: nothing has been added yet.
        """
        if self._count == 0:
            raise CryptoError("the ciphertext sum holds no contribution yet")
        return [
            bytes((acc - z).serialize()) for acc, z in zip(self._sums, self._offsets, strict=True)
        ]

    def digest(self) -> str:
        """:func:`sum_digest` of :meth:`serialize`: equal for the same contributions in any
        order.

        Raises:
            CryptoError: nothing has been added yet.
        """
        return sum_digest(self.serialize())


def decrypt_sum(secret_ctx: SecretContext, chunks: Sequence[bytes], dim: int) -> FloatVector:
    """Decrypt an aggregate (the key custodian's side), one chunk at a time.

    Returns:
        The ``dim`` summed values as float64.

    Raises:
        PayloadError: wrong chunk count, or a chunk over the size bound.
        CryptoError: a chunk does not deserialise or is not a ciphertext of the
            federation's level and scale.
    """
    params = secret_ctx.params
    if dim < 1:
        raise CryptoError(f"the vector length must be positive, got {dim}")
    _check_shape(chunks, params, dim)
    out = np.empty(dim, dtype=np.float64)
    for i, data in enumerate(chunks):
        vec = _load_chunk(secret_ctx.context, params, dim, i, data)
        start = i * params.slots
        out[start : start + _chunk_length(i, params, dim)] = vec.decrypt()
    return out


# -- the wire form of one contribution -----------------------------------------------------------

_U32 = 4


def frame_chunks(chunks: Sequence[bytes]) -> bytes:
    """One contribution's ciphertexts as one body: a little-endian u32 count, then each
    chunk as a u32 length and its bytes."""
    parts = [len(chunks).to_bytes(_U32, "little")]
    for chunk in chunks:
        parts += [len(chunk).to_bytes(_U32, "little"), bytes(chunk)]
    return b"".join(parts)


def unframe_chunks(raw: bytes, params: HeParams, dim: int) -> list[bytes]:
    """The chunks of a body made by :func:`frame_chunks`, every count and length checked
    against ``params`` and ``dim`` before a byte is copied.

    Raises:
        PayloadError: a truncated body, a count other than ``params.chunks(dim)``, a
            chunk over :attr:`HeParams.ciphertext_max_bytes`, or bytes after the last.
    """
    view = memoryview(raw)
    if len(view) < _U32:
        raise PayloadError("an encrypted update must start with its ciphertext count")
    count = int.from_bytes(view[:_U32], "little")
    expected = params.chunks(dim)
    if count != expected:
        raise PayloadError(
            f"an encrypted update of {dim} values has {expected} ciphertexts, not {count}"
        )
    chunks, at = [], _U32
    limit = params.ciphertext_max_bytes
    for index in range(count):
        if len(view) < at + _U32:
            raise PayloadError(f"ciphertext {index} is cut off before its length")
        length = int.from_bytes(view[at : at + _U32], "little")
        at += _U32
        if length > limit:
            raise PayloadError(f"ciphertext {index} declares {length} bytes, over {limit}")
        if len(view) < at + length:
            raise PayloadError(
                f"ciphertext {index} is cut off ({len(view) - at} of {length} bytes)"
            )
        chunks.append(bytes(view[at : at + length]))
        at += length
    if at != len(view):
        raise PayloadError(f"{len(view) - at} bytes follow the last ciphertext")
    return chunks
