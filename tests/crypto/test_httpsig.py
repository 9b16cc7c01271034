"""RFC 9421 request signing: round trips, refused forgeries and replays, nonce-cache rules.

Every negative test also checks that the verifier's nonce cache did not change.
"""

from __future__ import annotations

import base64
import datetime
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import http_sf
import nacl.signing
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from http_message_signatures import (
    ContentDigest,
    HTTPMessageSigner,
    MappingKeyResolver,
    algorithms,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import httpsig
from fedsec.crypto.httpsig import (
    COVERED_COMPONENTS,
    MAX_AUTH_FIELD_BYTES,
    NonceCache,
    RequestVerifier,
    sign_request,
)
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import AuthError, ClockSkewError, FedsecError, PayloadError, ReplayError

NOW = 1_700_000_000
SEED_A = bytes(range(32))
SEED_B = bytes(range(32, 64))
SEED_ATTACKER = bytes(range(64, 96))
ALICE = SigningIdentity(SEED_A)
BOB = SigningIdentity(SEED_B)
MALLORY = SigningIdentity(SEED_ATTACKER)  # not on the roster
ROSTER = {ALICE.key_id: ALICE.public_bytes, BOB.key_id: BOB.public_bytes}
PATH = "/v1/federations/f1/rounds/3/masked-input?stage=mask"
BODY = b"\x00\x01masked vector bytes\xff"
NONCE = "AAAAAAAAAAAAAAAAAAAAAA"
OTHER_NONCE = "BBBBBBBBBBBBBBBBBBBBBB"


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now


def make_verifier(
    max_entries: int = 1000, clock: Clock | None = None
) -> tuple[RequestVerifier, NonceCache]:
    cache = NonceCache(window_s=600.0, max_per_key=max_entries)
    return RequestVerifier(ROSTER.get, cache, max_skew_s=300.0, clock=clock or Clock()), cache


def signed(
    identity: SigningIdentity = ALICE,
    method: str = "POST",
    url: str = PATH,
    body: bytes = BODY,
    *,
    created: int = NOW,
    nonce: str = NONCE,
) -> dict[str, str]:
    return sign_request(identity, method, url, {}, body, created=created, nonce=nonce)


def library_signed(
    seed: bytes,
    *,
    keyid: str | None = None,
    method: str = "POST",
    url: str = PATH,
    body: bytes = BODY,
    components: tuple[str, ...] = COVERED_COMPONENTS,
    nonce: str | None = NONCE,
    tag: str | None = "fedsec",
    algorithm: type[algorithms.HTTPSignatureAlgorithm] = algorithms.ED25519,
    include_alg: bool = True,
) -> dict[str, str]:
    """A genuinely signed request with parameters ``sign_request`` would never choose."""
    key = Ed25519PrivateKey.from_private_bytes(seed)
    keyid = keyid or SigningIdentity(seed).key_id

    class View:
        def __init__(self) -> None:
            self.method = method
            self.url = "https://aggregator.example" + url
            self.headers: dict[str, str] = {}

    view = View()
    # Set the digest ourselves so `components` alone decides whether it is covered.
    view.headers["Content-Digest"] = ContentDigest.create(body)
    signer = HTTPMessageSigner(
        signature_algorithm=algorithm,
        key_resolver=MappingKeyResolver(public_keys={}, private_keys={keyid: key}),
    )
    signer.sign(
        view,
        key_id=keyid,
        created=datetime.datetime.fromtimestamp(NOW, tz=datetime.UTC),
        nonce=nonce,
        label="f",
        tag=tag,
        include_alg=include_alg,
        covered_component_ids=components,
        use_existing_digest=True,
    )
    return view.headers


@contextmanager
def refused(
    cache: NonceCache, error: type[FedsecError], match: str
) -> Iterator[pytest.ExceptionInfo[FedsecError]]:
    """Expect ``error`` and that the nonce cache is exactly as before."""
    before = (len(cache), cache.seen(ALICE.key_id, NONCE, NOW), cache.seen(BOB.key_id, NONCE, NOW))
    with pytest.raises(error, match=match) as info:
        yield info
    assert type(info.value) is error
    after = (len(cache), cache.seen(ALICE.key_id, NONCE, NOW), cache.seen(BOB.key_id, NONCE, NOW))
    assert after == before


def with_input(headers: Mapping[str, str], edit: Callable[[str], str]) -> dict[str, str]:
    out = dict(headers)
    out["Signature-Input"] = edit(out["Signature-Input"])
    return out


# ------------------------------------------------------------------- round trips
def test_round_trip_returns_key_id_and_records_nonce() -> None:
    verifier, cache = make_verifier()
    assert verifier.verify("POST", PATH, signed(), BODY) == ALICE.key_id
    assert len(cache) == 1
    assert cache.seen(ALICE.key_id, NONCE, NOW)


def test_signed_with_absolute_url_verifies_against_raw_path() -> None:
    verifier, _ = make_verifier()
    headers = signed(url="https://aggregator.example:8443" + PATH)
    assert verifier.verify("POST", PATH, headers, BODY) == ALICE.key_id


def test_a_request_without_a_body_is_signed_without_a_digest_and_must_stay_bodiless() -> None:
    verifier, cache = make_verifier()
    target = "/v1/rounds/current"
    headers = signed(method="GET", url=target, body=b"")
    assert "Content-Digest" not in headers
    assert headers["Signature-Input"].startswith('f=("@method" "@path" "@query");')
    assert verifier.verify("GET", target, headers, b"") == ALICE.key_id
    assert len(cache) == 1
    bodiless = signed(method="GET", url=target, body=b"", nonce=OTHER_NONCE)
    # a body the signature does not bind is refused, and burns no nonce
    with refused(cache, AuthError, "unsigned body"):
        verifier.verify("GET", target, bodiless, b"x")
    # so is a digest sent beside a signature that does not cover it
    unsigned_digest = {**bodiless, "Content-Digest": ContentDigest.create(b"x")}
    with refused(cache, AuthError, "does not cover required component 'content-digest'"):
        verifier.verify("GET", target, unsigned_digest, b"x")
    # and a signature that covers a digest the request does not carry
    covered = signed(method="GET", url=target, body=BODY, nonce=OTHER_NONCE)
    del covered["Content-Digest"]
    with refused(cache, AuthError, "missing Content-Digest header"):
        verifier.verify("GET", target, covered, BODY)


def test_content_digest_matches_rfc9530_example() -> None:
    headers = signed(body=b'{"hello": "world"}')
    assert headers["Content-Digest"] == "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"


def test_signature_is_plain_rfc9421_ed25519_over_the_signature_base() -> None:
    headers = signed()
    params = headers["Signature-Input"].removeprefix("f=")
    assert params == (
        '("@method" "@path" "@query" "content-digest");'
        f'created={NOW};keyid="{ALICE.key_id}";nonce="{NONCE}";tag="fedsec"'
    )
    base = (
        '"@method": POST\n'
        '"@path": /v1/federations/f1/rounds/3/masked-input\n'
        '"@query": ?stage=mask\n'
        f'"content-digest": {headers["Content-Digest"]}\n'
        f'"@signature-params": {params}'
    ).encode()
    match = re.fullmatch(r"f=:([A-Za-z0-9+/=]+):", headers["Signature"])
    assert match is not None
    nacl.signing.VerifyKey(ALICE.public_bytes).verify(base, base64.b64decode(match[1]))


def test_fresh_nonces_are_random_128_bit_base64url() -> None:
    nonces = set()
    for _ in range(20):
        text = sign_request(ALICE, "POST", PATH, {}, BODY)["Signature-Input"]
        match = re.search(r'nonce="([^"]*)"', text)
        assert match is not None and re.fullmatch(r"[A-Za-z0-9_-]{22}", match[1])
        nonces.add(match[1])
    assert len(nonces) == 20


def test_signer_refuses_conflicting_headers_and_bad_input() -> None:
    with pytest.raises(ValueError, match="already contain content-digest"):
        sign_request(ALICE, "POST", PATH, {"content-digest": "x"}, BODY)
    with pytest.raises(ValueError, match="uppercase"):
        sign_request(ALICE, "post", PATH, {}, BODY)
    with pytest.raises(ValueError, match="base64url"):
        sign_request(ALICE, "POST", PATH, {}, BODY, nonce="short")
    with pytest.raises(ValueError, match="path starting with"):
        sign_request(ALICE, "POST", "v1/rounds", {}, BODY)


def test_signature_base_signer_keeps_clear_of_domain_separated_messages() -> None:
    with pytest.raises(ValueError, match="quoted component name"):
        httpsig._sign_signature_base(ALICE, b"fedsec/v1/receipt\x00anything")


# --------------------------------------------------------------------- tampering
def test_tampered_body_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, AuthError, "content digest mismatch"):
        verifier.verify("POST", PATH, signed(), BODY + b"\x00")


def test_tampered_path_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", PATH.replace("rounds/3", "rounds/4"), signed(), BODY)


def test_tampered_or_added_query_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", PATH.replace("mask", "unmask"), signed(), BODY)
    no_query = "/v1/rounds/3/input"
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", no_query + "?admin=1", signed(url=no_query), BODY)


def test_tampered_method_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("PUT", PATH, signed(), BODY)


def test_tampered_content_digest_header_is_refused() -> None:
    # A consistent swap: body B with B's correct digest under A's signature.
    verifier, cache = make_verifier()
    other = b"poisoned update"
    headers = signed()
    headers["Content-Digest"] = signed(body=other)["Content-Digest"]
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", PATH, headers, other)


def test_tampered_signature_parameters_are_refused() -> None:
    verifier, cache = make_verifier()
    for edit in (
        lambda s: s.replace(f"created={NOW}", f"created={NOW + 1}"),
        lambda s: s.replace(NONCE, OTHER_NONCE),
    ):
        with refused(cache, AuthError, "bad signature"):
            verifier.verify("POST", PATH, with_input(signed(), edit), BODY)


def test_removed_component_is_refused() -> None:
    verifier, cache = make_verifier()
    stripped = with_input(signed(), lambda s: s.replace('"@path" ', ""))
    with refused(cache, AuthError, "does not cover required component '@path'"):
        verifier.verify("POST", PATH, stripped, BODY)
    # Also when genuinely signed that way: coverage is policy, not just a broken signature.
    for missing in COVERED_COMPONENTS:
        components = tuple(c for c in COVERED_COMPONENTS if c != missing)
        headers = library_signed(SEED_A, components=components)
        with refused(cache, AuthError, f"does not cover required component '{missing}'"):
            verifier.verify("POST", PATH, headers, BODY)


def test_extra_or_parameterised_components_are_refused() -> None:
    verifier, cache = make_verifier()
    extra = with_input(signed(), lambda s: s.replace('"@query"', '"@query" "@authority"'))
    with refused(cache, AuthError, "unexpected component"):
        verifier.verify("POST", PATH, extra, BODY)
    with_sf = with_input(signed(), lambda s: s.replace('"content-digest"', '"content-digest";sf'))
    with refused(cache, AuthError, "carries parameters"):
        verifier.verify("POST", PATH, with_sf, BODY)


# ---------------------------------------------------------------------- keys
def test_signature_by_another_key_is_refused() -> None:
    verifier, cache = make_verifier()
    # Bob signs but claims to be Alice.
    claimed = library_signed(SEED_B, keyid=ALICE.key_id)
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", PATH, claimed, BODY)
    # Bob's signature value grafted onto Alice's otherwise identical request.
    grafted = signed()
    grafted["Signature"] = library_signed(SEED_B, keyid=ALICE.key_id)["Signature"]
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", PATH, grafted, BODY)


def test_unknown_key_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, AuthError, f"unknown or revoked key {MALLORY.key_id}"):
        verifier.verify("POST", PATH, signed(MALLORY), BODY)


def test_revoked_key_is_refused() -> None:
    cache = NonceCache(600.0, 10)
    roster = dict(ROSTER)
    verifier = RequestVerifier(roster.get, cache, clock=Clock())
    del roster[ALICE.key_id]
    with refused(cache, AuthError, "unknown or revoked key"):
        verifier.verify("POST", PATH, signed(), BODY)


def test_a_key_revoked_after_it_verified_is_refused() -> None:
    # the verifier keeps built keys; the roster's answer still decides every request
    cache = NonceCache(600.0, 10)
    roster = dict(ROSTER)
    verifier = RequestVerifier(roster.get, cache, clock=Clock())
    assert verifier.verify("POST", PATH, signed(nonce="a" * 22), BODY) == ALICE.key_id
    del roster[ALICE.key_id]
    with refused(cache, AuthError, "unknown or revoked key"):
        verifier.verify("POST", PATH, signed(), BODY)
    roster[ALICE.key_id] = BOB.public_bytes  # replaced by another key under the same id
    with refused(cache, AuthError, "fingerprint"):
        verifier.verify("POST", PATH, signed(), BODY)


def test_roster_key_must_match_keyid_fingerprint() -> None:
    cache = NonceCache(600.0, 10)
    verifier = RequestVerifier(lambda _kid: BOB.public_bytes, cache, clock=Clock())
    with refused(cache, AuthError, "fingerprint"):
        verifier.verify("POST", PATH, signed(), BODY)


# -------------------------------------------------------------------- replays
def test_replay_is_refused_the_second_time() -> None:
    verifier, cache = make_verifier()
    headers = signed()
    verifier.verify("POST", PATH, headers, BODY)
    with refused(cache, ReplayError, "replayed nonce"):
        verifier.verify("POST", PATH, headers, BODY)
    assert len(cache) == 1
    # The same nonce from another key is a different request.
    assert verifier.verify("POST", PATH, signed(BOB), BODY) == BOB.key_id


def test_replay_after_window_is_caught_by_timestamp() -> None:
    clock = Clock()
    verifier, cache = make_verifier(clock=clock)
    headers = signed()
    verifier.verify("POST", PATH, headers, BODY)
    clock.now = NOW + 301
    with refused(cache, ClockSkewError, "stale timestamp"):
        verifier.verify("POST", PATH, headers, BODY)


@pytest.mark.parametrize(
    ("offset", "accepted", "match"),
    [
        (-300, True, ""),
        (300, True, ""),
        (-301, False, r"stale timestamp: .* 301 s ago"),
        (301, False, r"stale timestamp: .* 301 s in the future"),
        (-86_400, False, "stale timestamp"),
    ],
)
def test_created_must_be_within_the_skew_window(offset: int, accepted: bool, match: str) -> None:
    verifier, cache = make_verifier()
    headers = signed(created=NOW + offset)
    if accepted:
        assert verifier.verify("POST", PATH, headers, BODY) == ALICE.key_id
    else:
        with refused(cache, ClockSkewError, match):
            verifier.verify("POST", PATH, headers, BODY)


def test_missing_nonce_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, ReplayError, "missing nonce"):
        verifier.verify("POST", PATH, library_signed(SEED_A, nonce=None), BODY)


def test_forged_request_does_not_burn_the_nonce() -> None:
    verifier, cache = make_verifier()
    # Mallory guesses (or observes in flight) Alice's next nonce and sends a forgery first.
    forged = library_signed(SEED_ATTACKER, keyid=ALICE.key_id, body=b"junk")
    with refused(cache, AuthError, "bad signature"):
        verifier.verify("POST", PATH, forged, b"junk")
    # A genuine signature with a tampered body is refused too, and also burns nothing.
    with refused(cache, AuthError, "content digest mismatch"):
        verifier.verify("POST", PATH, signed(), b"junk")
    assert not cache.seen(ALICE.key_id, NONCE, NOW)
    assert verifier.verify("POST", PATH, signed(), BODY) == ALICE.key_id
    assert cache.seen(ALICE.key_id, NONCE, NOW)


# ---------------------------------------------------------- malformed headers
@pytest.mark.parametrize("name", ["Signature", "Signature-Input", "Content-Digest"])
def test_missing_header_is_refused(name: str) -> None:
    verifier, cache = make_verifier()
    headers = signed()
    del headers[name]
    with refused(cache, AuthError, f"missing {name} header"):
        verifier.verify("POST", PATH, headers, BODY)


@pytest.mark.parametrize("name", ["Signature", "Signature-Input", "Content-Digest"])
def test_oversized_header_is_refused_before_parsing(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier, cache = make_verifier()
    headers = signed()
    headers[name] += ", x=" + "a" * MAX_AUTH_FIELD_BYTES

    def must_not_parse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an oversized header reached the parser")

    monkeypatch.setattr(http_sf, "parse", must_not_parse)
    with refused(cache, PayloadError, f"{name} header is \\d+ bytes, over the 4096-byte limit"):
        verifier.verify("POST", PATH, headers, BODY)


def test_repeated_header_is_refused() -> None:
    verifier, cache = make_verifier()

    class MultiHeaders(dict[str, str]):
        """Like aiohttp's CIMultiDictProxy: items() yields every field line."""

        def items(self) -> Iterator[tuple[str, str]]:  # type: ignore[override]
            yield from super().items()
            yield "signature", self["Signature"]

    with refused(cache, PayloadError, "Signature header appears more than once"):
        verifier.verify("POST", PATH, MultiHeaders(signed()), BODY)
    case_variants = signed()
    case_variants["content-digest"] = case_variants["Content-Digest"]
    with refused(cache, PayloadError, "Content-Digest header appears more than once"):
        verifier.verify("POST", PATH, case_variants, BODY)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("Signature-Input", "f=(", "malformed Signature-Input header"),
        ("Signature", "f=:not base64!:", "malformed Signature header"),
        ("Signature", "f=:AAAA:", "Ed25519 signature is 64 bytes, got 3"),
        ("Signature", 'f="text"', "must be a byte sequence"),
        ("Signature-Input", 'f="@method"', "must be an inner list"),
        ("Signature-Input", "f=(@method)", "malformed Signature-Input"),
        ("Signature-Input", 'a=("@method"), a=("@path")', "duplicate key"),
        ("Content-Digest", "sha-512=:AAAA:", "exactly one sha-256 digest"),
        ("Content-Digest", "sha-256=:AAAA:", "sha-256 digest is 32 bytes, got 3"),
        ("Content-Digest", "sha-256=1", "must be a byte sequence"),
        ("Signature", "f=:" + "A" * 88 + ":, other=:AAAA:", "exactly one signature"),
    ],
)
def test_malformed_header_is_refused(name: str, value: str, match: str) -> None:
    verifier, cache = make_verifier()
    headers = signed()
    headers[name] = value
    with refused(cache, PayloadError, match):
        verifier.verify("POST", PATH, headers, BODY)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.replace(f"created={NOW}", f'created="{NOW}"'), "'created' must be an integer"),
        (lambda s: s.replace(f"created={NOW}", "created=?1"), "'created' must be an integer"),
        (lambda s: s.replace('keyid="ed25519:', 'keyid="rsa:'), "'keyid' must be"),
        (lambda s: s.replace(f'nonce="{NONCE}"', "nonce=1"), "'nonce' must be a string"),
        (lambda s: s.replace(NONCE, "short"), "nonce must be 22 to 64"),
        (lambda s: s.replace("f=(", "other=("), "labelled 'f'"),
    ],
)
def test_malformed_signature_parameters_are_refused(edit: Callable[[str], str], match: str) -> None:
    verifier, cache = make_verifier()
    with refused(cache, PayloadError, match):
        verifier.verify("POST", PATH, with_input(signed(), edit), BODY)


def test_malformed_method_or_target_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, PayloadError, "uppercase"):
        verifier.verify("post", PATH, signed(), BODY)
    with refused(cache, PayloadError, "malformed request target"):
        verifier.verify("POST", "/v1/rounds 3", signed(), BODY)
    with refused(cache, PayloadError, "over 8190"):
        verifier.verify("POST", "/" + "a" * 9000, signed(), BODY)


# ------------------------------------------------------------ algorithm, tag
class _MislabelledEd25519(algorithms.ED25519):
    algorithm_id = "hmac-sha256"


def test_wrong_alg_is_refused_even_when_validly_signed() -> None:
    verifier, cache = make_verifier()
    headers = library_signed(SEED_A, algorithm=_MislabelledEd25519)
    assert 'alg="hmac-sha256"' in headers["Signature-Input"]
    with refused(cache, AuthError, "wrong alg 'hmac-sha256'"):
        verifier.verify("POST", PATH, headers, BODY)


def test_a_signature_labelled_as_before_the_short_label_still_verifies() -> None:
    verifier, cache = make_verifier()
    headers = signed()
    old = {
        **headers,
        "Signature-Input": headers["Signature-Input"].replace("f=", "fedsec=", 1),
        "Signature": headers["Signature"].replace("f=", "fedsec=", 1),
    }
    assert verifier.verify("POST", PATH, old, BODY) == ALICE.key_id
    mixed = {**headers, "Signature": old["Signature"]}
    with refused(cache, PayloadError, "exactly one signature"):
        verifier.verify("POST", PATH, mixed, BODY)


def test_alg_may_be_left_to_the_key() -> None:
    # RFC 9421 §3.3.7: the key id names an Ed25519 key, so alg is optional; fedsec's
    # own signer leaves it out, another RFC 9421 signer may name it
    verifier, _ = make_verifier()
    assert 'alg="ed25519"' in library_signed(SEED_A)["Signature-Input"]
    assert verifier.verify("POST", PATH, library_signed(SEED_A), BODY) == ALICE.key_id
    assert "alg=" not in signed()["Signature-Input"]


def test_wrong_or_missing_tag_is_refused() -> None:
    verifier, cache = make_verifier()
    with refused(cache, AuthError, "wrong tag 'other-app'"):
        verifier.verify("POST", PATH, library_signed(SEED_A, tag="other-app"), BODY)
    with refused(cache, AuthError, "wrong tag None"):
        verifier.verify("POST", PATH, library_signed(SEED_A, tag=None), BODY)


def test_unexpected_signature_parameter_is_refused() -> None:
    verifier, cache = make_verifier()
    headers = with_input(signed(), lambda s: s + f";expires={NOW + 60}")
    with refused(cache, AuthError, r"unexpected signature parameter\(s\) \['expires'\]"):
        verifier.verify("POST", PATH, headers, BODY)


# ----------------------------------------------------------------- nonce cache
def test_nonce_cache_forgets_only_after_the_window() -> None:
    cache = NonceCache(window_s=600.0, max_per_key=10)
    cache.remember("k", NONCE, NOW, now=NOW)
    assert cache.seen("k", NONCE, NOW + 600)
    with pytest.raises(ReplayError, match="replayed nonce"):
        cache.remember("k", NONCE, NOW, now=NOW + 600)
    assert not cache.seen("k", NONCE, NOW + 601)
    # Once expired it may be remembered again (a request that old is refused as stale anyway).
    cache.remember("k", NONCE, NOW + 601, now=NOW + 601)
    assert len(cache) == 1


def test_nonce_cache_refuses_stale_entries() -> None:
    cache = NonceCache(window_s=600.0, max_per_key=10)
    with pytest.raises(ReplayError, match="stale timestamp"):
        cache.remember("k", NONCE, NOW, now=NOW + 601)
    assert len(cache) == 0


def test_full_nonce_cache_evicts_expired_entries_oldest_first() -> None:
    cache = NonceCache(window_s=100.0, max_per_key=3)
    for i, created in enumerate((NOW, NOW + 10, NOW + 20)):
        cache.remember("k", f"{i:022d}", created, now=created)
    cache.remember("k", "x" * 22, NOW + 105, now=NOW + 105)  # only the first has expired
    assert len(cache) == 3
    assert not cache.seen("k", f"{0:022d}", NOW + 105)
    assert cache.seen("k", f"{1:022d}", NOW + 105)


def test_full_nonce_cache_refuses_rather_than_forgets() -> None:
    cache = NonceCache(window_s=100.0, max_per_key=2)
    cache.remember("k", NONCE, NOW, now=NOW)
    cache.remember("k", OTHER_NONCE, NOW, now=NOW)
    with pytest.raises(ReplayError, match="nonce quota full"):
        cache.remember("k", "C" * 22, NOW, now=NOW + 50)
    assert len(cache) == 2
    assert cache.seen("k", NONCE, NOW + 50) and cache.seen("k", OTHER_NONCE, NOW + 50)


def test_verifier_refuses_when_nonce_cache_is_full() -> None:
    verifier, cache = make_verifier(max_entries=1)
    verifier.verify("POST", PATH, signed(nonce=OTHER_NONCE), BODY)
    with refused(cache, ReplayError, "nonce quota full"):
        verifier.verify("POST", PATH, signed(), BODY)


def test_one_key_filling_its_nonce_quota_does_not_lock_out_another() -> None:
    cache = NonceCache(window_s=100.0, max_per_key=2)
    cache.remember("alice", NONCE, NOW, now=NOW)
    cache.remember("alice", OTHER_NONCE, NOW, now=NOW)
    with pytest.raises(ReplayError, match="nonce quota full"):
        cache.remember("alice", "C" * 22, NOW, now=NOW)
    cache.remember("bob", NONCE, NOW + 50, now=NOW)
    cache.remember("bob", OTHER_NONCE, NOW + 50, now=NOW)
    assert len(cache) == 4
    # alice's share frees as her entries expire, without touching bob's
    cache.remember("alice", "C" * 22, NOW + 101, now=NOW + 101)
    assert cache.seen("bob", NONCE, NOW + 101) and len(cache) == 3


def test_configuration_is_validated() -> None:
    with pytest.raises(ValueError, match="shorter than the clock skew window"):
        RequestVerifier(ROSTER.get, NonceCache(60.0, 10), max_skew_s=300.0)
    with pytest.raises(ValueError, match="positive"):
        NonceCache(0.0, 10)
    with pytest.raises(ValueError, match="at least one entry"):
        NonceCache(600.0, 0)
    with pytest.raises(ValueError, match="positive"):
        RequestVerifier(ROSTER.get, NonceCache(600.0, 10), max_skew_s=float("nan"))


# ------------------------------------------------------------------ properties
_SEGMENT = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~%20",
    min_size=1,
    max_size=12,
).filter(lambda s: "%" not in s.replace("%20", ""))
_QUERY = st.none() | st.lists(
    st.tuples(
        st.from_regex(r"[a-z]{1,8}", fullmatch=True),
        st.from_regex(r"[0-9A-Za-z]{0,8}", fullmatch=True),
    ),
    max_size=3,
).map(lambda pairs: "&".join(f"{k}={v}" for k, v in pairs))
_PATHS = st.builds(
    lambda segments, query: "/" + "/".join(segments) + ("" if query is None else "?" + query),
    st.lists(_SEGMENT, max_size=5),
    _QUERY,
)


@settings(max_examples=60, deadline=None)
@given(body=st.binary(max_size=2048), path=_PATHS, method=st.sampled_from(["GET", "POST", "PUT"]))
def test_property_round_trip(body: bytes, path: str, method: str) -> None:
    verifier, cache = make_verifier()
    headers = sign_request(ALICE, method, path, {}, body, created=NOW)
    assert verifier.verify(method, path, headers, body) == ALICE.key_id
    assert len(cache) == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data(), body=st.binary(min_size=1, max_size=2048), path=_PATHS)
def test_property_any_single_byte_flip_fails(data: st.DataObject, body: bytes, path: str) -> None:
    verifier, cache = make_verifier()
    headers = sign_request(ALICE, "POST", path, {}, body, created=NOW, nonce=NONCE)
    index = data.draw(st.integers(0, len(body) - 1), label="index")
    mask = data.draw(st.integers(1, 255), label="mask")
    flipped = bytearray(body)
    flipped[index] ^= mask
    with refused(cache, AuthError, "content digest mismatch"):
        verifier.verify("POST", path, headers, bytes(flipped))
