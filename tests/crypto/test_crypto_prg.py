"""The mask PRG: published vectors for its primitives, then the properties masks rely on."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import prg

# NIST SP 800-38A, F.5.5 CTR-AES256.Encrypt
NIST_KEY = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
NIST_COUNTER = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
NIST_BLOCKS = [
    # (output block = keystream, plaintext, ciphertext)
    (
        "0bdf7df1591716335e9a8b15c860c502",
        "6bc1bee22e409f96e93d7e117393172a",
        "601ec313775789a5b7a7f504bbf3d228",
    ),
    (
        "5a6e699d536119065433863c8f657b94",
        "ae2d8a571e03ac9c9eb76fac45af8e51",
        "f443e3ca4d62b59aca84e990cacaf5c5",
    ),
    (
        "1bc12c9c01610d5d0d8bd6a3378eca62",
        "30c81c46a35ce411e5fbc1191a0a52ef",
        "2b0930daa23de94ce87017ba2d84988d",
    ),
    (
        "2956e1c8693536b1bee99c73a31576b6",
        "f69f2445df4f9b17ad2b417be66c3710",
        "dfc9c58db67aada613c2dd08457941a6",
    ),
]

# RFC 5869, A.1 (test case 1: basic test case with SHA-256)
RFC5869_IKM = bytes([0x0B] * 22)
RFC5869_SALT = bytes(range(0x00, 0x0D))
RFC5869_INFO = bytes(range(0xF0, 0xFA))
RFC5869_PRK = bytes.fromhex("077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5")
RFC5869_OKM = bytes.fromhex(
    "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
)

SEED = bytes(range(32))


def _aes_ctr(key: bytes, counter: bytes, data: bytes) -> bytes:
    encryptor = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    return encryptor.update(data) + encryptor.finalize()


def _hkdf_sha256_by_hand(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 written out with the standard library, independent of ``cryptography``."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


# -- known-answer vectors ----------------------------------------------------------------------


def test_aes256_ctr_nist_sp800_38a_f55_encrypt() -> None:
    plaintext = b"".join(bytes.fromhex(p) for _, p, _ in NIST_BLOCKS)
    expected = b"".join(bytes.fromhex(c) for _, _, c in NIST_BLOCKS)
    assert _aes_ctr(NIST_KEY, NIST_COUNTER, plaintext) == expected


def test_aes256_ctr_nist_keystream_blocks_match_output_blocks() -> None:
    # prg.keystream encrypts zeros, i.e. returns exactly the "Output Block" column.
    keystream = _aes_ctr(NIST_KEY, NIST_COUNTER, bytes(16 * len(NIST_BLOCKS)))
    assert keystream == b"".join(bytes.fromhex(o) for o, _, _ in NIST_BLOCKS)


def test_aes256_ctr_nist_decrypt_is_the_same_operation() -> None:
    ciphertext = b"".join(bytes.fromhex(c) for _, _, c in NIST_BLOCKS)
    plaintext = b"".join(bytes.fromhex(p) for _, p, _ in NIST_BLOCKS)
    assert _aes_ctr(NIST_KEY, NIST_COUNTER, ciphertext) == plaintext


def test_hkdf_sha256_rfc5869_case1() -> None:
    okm = HKDF(algorithm=hashes.SHA256(), length=42, salt=RFC5869_SALT, info=RFC5869_INFO).derive(
        RFC5869_IKM
    )
    assert okm == RFC5869_OKM
    assert hmac.new(RFC5869_SALT, RFC5869_IKM, hashlib.sha256).digest() == RFC5869_PRK
    assert _hkdf_sha256_by_hand(RFC5869_IKM, RFC5869_SALT, RFC5869_INFO, 42) == RFC5869_OKM


# -- prg composes the primitives as documented -------------------------------------------------


def test_derive_key_is_hkdf_sha256_with_prefixed_info_and_no_salt() -> None:
    expected = _hkdf_sha256_by_hand(SEED, b"", b"fedsec/v1/prg/masks", 32)
    assert prg.derive_key(SEED, b"masks") == expected


def test_keystream_is_aes256_ctr_from_zero_counter_under_derived_key() -> None:
    key = prg.derive_key(SEED, b"masks")
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    counters = b"".join(i.to_bytes(16, "big") for i in range(3))
    expected = ecb.update(counters) + ecb.finalize()
    assert prg.keystream(SEED, b"masks", 48) == expected
    # a length that is not a multiple of the block is a prefix of the longer stream
    assert prg.keystream(SEED, b"masks", 37) == expected[:37]


def test_keystream_pinned_regression_vector() -> None:
    # Any change to the derivation (info prefix, counter, cipher) changes every mask
    # and breaks interoperability between agent and aggregator versions.
    key = _hkdf_sha256_by_hand(bytes(32), b"", b"fedsec/v1/prg/secagg/self-mask", 32)
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    assert prg.keystream(bytes(32), b"secagg/self-mask", 16) == ecb.update(bytes(16))


def test_derive_key_refuses_wrong_seed_length() -> None:
    with pytest.raises(ValueError):
        prg.derive_key(bytes(31), b"x")
    with pytest.raises(ValueError):
        prg.keystream(bytes(33), b"x", 16)


def test_keystream_refuses_negative_length() -> None:
    with pytest.raises(ValueError):
        prg.keystream(SEED, b"x", -1)


# -- properties --------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    seed=st.binary(min_size=32, max_size=32),
    domain=st.binary(max_size=20),
    other=st.binary(max_size=20),
    count=st.integers(1, 64),
)
def test_expand_deterministic_and_domain_separated(
    seed: bytes, domain: bytes, other: bytes, count: int
) -> None:
    a = prg.expand(seed, domain, count, np.uint32)
    b = prg.expand(seed, domain, count, np.uint32)
    np.testing.assert_array_equal(a, b)
    if other != domain:
        c = prg.expand(seed, other, count, np.uint32)
        # 32*count random bits colliding is negligible
        assert not np.array_equal(a, c)


def test_expand_differs_across_seeds() -> None:
    a = prg.expand(SEED, b"d", 16, np.uint64)
    b = prg.expand(bytes(32), b"d", 16, np.uint64)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_expand_each_unsigned_dtype(dtype: type[np.unsignedinteger]) -> None:
    count = 1001
    out = prg.expand(SEED, b"dtype", count, dtype)
    assert out.dtype == np.dtype(dtype)
    assert out.shape == (count,)
    # little-endian interpretation of the keystream, whatever the host byte order
    raw = prg.keystream(SEED, b"dtype", count * np.dtype(dtype).itemsize)
    expected = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    np.testing.assert_array_equal(out, expected)
    # the whole dtype range is used: the top bit is set about half the time
    top = int(np.dtype(dtype).itemsize * 8 - 1)
    frac = float(np.mean((out >> np.array(top, dtype=dtype)) & 1))
    assert 0.4 < frac < 0.6


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.bool_])
def test_expand_refuses_non_unsigned_dtype(dtype: type) -> None:
    with pytest.raises(ValueError):
        prg.expand(SEED, b"d", 4, dtype)


def test_expand_output_is_read_only() -> None:
    out = prg.expand(SEED, b"d", 4, np.uint16)
    with pytest.raises(ValueError):
        out[0] = 1


def test_expand_bytes_uniform_chi_square() -> None:
    samples = prg.expand(SEED, b"uniformity", 256 * 400, np.uint8)
    counts = np.bincount(samples, minlength=256)
    expected = samples.size / 256
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    # 255 degrees of freedom: mean 255, sd ~22.6; 400 is > 6 sd away (loose on purpose)
    assert 150 < chi2 < 400


def test_expand_masked_to_ring_bits_is_uniform() -> None:
    # masks are reduced mod 2^m by masking; 2^m divides the dtype modulus so it stays uniform
    words = prg.expand(SEED, b"ring", 16 * 2000, np.uint32) & np.uint32((1 << 4) - 1)
    counts = np.bincount(words, minlength=16)
    expected = words.size / 16
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 60  # 15 dof: mean 15, sd ~5.5


def test_uniform01_range_and_mean() -> None:
    u = prg.uniform01(SEED, b"u", 50_000)
    assert u.dtype == np.float32
    assert float(u.min()) >= 0.0
    assert float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    np.testing.assert_array_equal(u, prg.uniform01(SEED, b"u", 50_000))


def test_zero_length_expand() -> None:
    assert prg.expand(SEED, b"d", 0, np.uint32).size == 0


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 100, 70_001])
def test_expand_into_writes_the_same_values_in_place(count: int) -> None:
    seed = bytes(range(32))
    out = np.full(count, 7, dtype=np.uint32)
    prg.expand_into(seed, b"x", out)
    np.testing.assert_array_equal(out, prg.expand(seed, b"x", count, np.uint32))


def test_expand_into_refuses_a_signed_or_strided_buffer() -> None:
    with pytest.raises(ValueError, match="unsigned"):
        prg.expand_into(bytes(32), b"x", np.zeros(8, dtype=np.int32))
    with pytest.raises(ValueError, match="unsigned"):
        prg.expand_into(bytes(32), b"x", np.zeros(16, dtype=np.uint32)[::2])


@given(
    first=st.integers(min_value=0, max_value=300),
    count=st.integers(min_value=0, max_value=70),
    dtype=st.sampled_from([np.uint8, np.uint32, np.uint64]),
)
@settings(max_examples=60, deadline=None)
def test_expand_into_at_continues_the_stream_from_any_value(
    first: int, count: int, dtype: type[np.unsignedinteger]
) -> None:
    # offsets inside an AES block as well as on its edges
    out = np.full(count, 7, dtype=dtype)
    prg.expand_into_at(SEED, b"x", first, out)
    np.testing.assert_array_equal(out, prg.expand(SEED, b"x", first + count, dtype)[first:])


def test_expand_into_at_refuses_a_negative_start_or_a_signed_buffer() -> None:
    out = np.full(8, 7, dtype=np.uint32)
    with pytest.raises(ValueError, match="first value"):
        prg.expand_into_at(SEED, b"x", -1, out)
    with pytest.raises(ValueError, match="unsigned"):
        prg.expand_into_at(SEED, b"x", 0, np.zeros(8, dtype=np.int32))
    assert np.all(out == 7)
