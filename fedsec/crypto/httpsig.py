"""Request authentication: RFC 9421 HTTP Message Signatures with Ed25519.

An agent signs every request to the aggregator with its identity key; the
aggregator verifies it before acting on it.  The maintained
``http_message_signatures`` library signs (it builds the RFC 9421 signature base); the
verifier parses the fields, resolves a path-and-query target and builds the base
itself, for the one shape of signature fedsec accepts, because the library's general
path (``http_sf``'s parser and serializer, run twice, and a resolver per request) cost
four times the Ed25519 check on every request; the library resolves whatever other
target comes.  Tests hold all three to the general code: the fields' parse to
``http_sf``'s, the derived components to the library's resolver, the base to the
library's verifier.  The Ed25519 check is libsodium's (pynacl, as for fedsec's other
signatures).  The checks come in this order:

1. sizes of the authentication fields (``Signature-Input``, ``Signature`` and, for a
   request with a body, ``Content-Digest``), each present at most once;
2. their syntax (Structured Fields, RFC 8941), one signature labelled ``f``: two
   regular expressions read the exact fields fedsec's signer writes, a strict parser
   the canonical serialization every RFC 9421 signer writes, and ``http_sf`` whatever
   else (whitespace, escapes, other types), refusing as before;
3. what the signature must say: exactly the covered components in
   :data:`COVERED_COMPONENTS` (:data:`BODILESS_COMPONENTS` for a request without a
   body, see below), ``tag="fedsec"``, a well-formed ``keyid`` and ``nonce``,
   ``alg="ed25519"`` if it names an algorithm at all, and a ``created`` time within
   the clock-skew window;
4. the nonce has not been seen (read-only look-up, so replays fail fast);
5. the key id names a key the roster accepts;
6. the Ed25519 signature over the RFC 9421 signature base (§2.5), built from the
   checked claims;
7. the body against the signed ``Content-Digest`` (RFC 9530, sha-256,
   constant-time comparison), or, for a signature without one, that there is no body;
8. only then is the nonce recorded, so a forged request can never burn a nonce.

Steps 1-6 need only the request line and headers (:meth:`RequestVerifier.verify_headers`),
so a server checks them before it reads a byte of the body and an unauthenticated
client can never make it buffer one; steps 7-8 (:meth:`RequestVerifier.verify_body`)
follow once the body is in.

Covered components and why: ``@method`` and ``@path`` bind the action and the
route (which carries federation, round and stage); ``@query`` is *always*
covered (its value is ``?`` when the URL has none), so a query string can be
neither changed nor added; ``content-digest`` binds the body.  A request without a
body (every GET) is signed over the first three alone and carries no
``Content-Digest``: the digest of an empty body is a constant that could only say
"no body", and the verifier requires exactly that of a signature that does not cover
one, so nothing is left unbound and ~85 bytes leave every such request.  Scheme and
authority (``@target-uri``, ``@authority``) are deliberately *not* covered: behind
a TLS-terminating reverse proxy the aggregator sees a different scheme and host
than the agent dialled, and binding them would make valid requests fail.  The
cost is that a request signed for one aggregator verifies at another that
enrols the same agent key, unless federation and round in the path differ.

The signature is standard RFC 9421 ``ed25519`` (Ed25519 over the signature base
itself), so any RFC 9421 verifier can check it.  The signer leaves ``alg`` out: RFC 9421
§3.3.7 lets the key determine the algorithm, and a fedsec key id names an Ed25519 key
and nothing else (``ed25519:`` and its fingerprint), so the parameter would repeat the
key id on every request; a verifier still refuses any other ``alg`` a signer names.
The label is one letter for the same reason: it is not signed (the signed ``tag``
marks a fedsec signature), it only pairs ``Signature-Input`` with ``Signature``.

fedsec's other signatures are domain separated (``fedsec/v1/<domain>\\x00…``, see
:mod:`fedsec.crypto.identity`); an RFC 9421 signature base always begins with ``"``
(a quoted component name) while every domain-separated message begins with ``f``, so
no signature of one kind is ever a valid signature of the other.  :func:`_sign_signature_base`
enforces that first byte before signing.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import heapq
import hmac
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

import http_sf
from http_message_signatures import (
    HTTPMessageSignaturesException,
    HTTPMessageSigner,
    HTTPSignatureComponentResolver,
    algorithms,
)

from fedsec.crypto.errors import (
    AuthError,
    ClockSkewError,
    PayloadError,
    ReplayError,
    SignatureError,
)
from fedsec.crypto.identity import PublicIdentity, SigningIdentity

__all__ = [
    "BODILESS_COMPONENTS",
    "COVERED_COMPONENTS",
    "DEFAULT_MAX_SKEW_S",
    "DEFAULT_NONCES_PER_KEY",
    "MAX_AUTH_FIELD_BYTES",
    "MAX_CACHED_KEYS",
    "MAX_TARGET_BYTES",
    "NonceCache",
    "NonceStore",
    "RequestVerifier",
    "SignedHeaders",
    "sign_request",
]

# --------------------------------------------------------------------------- limits
#: Largest accepted value of each authentication field, checked before parsing.
#: A fedsec Signature-Input is ~190 bytes, a Signature ~100, a Content-Digest ~55;
#: 4 KiB leaves room for longer key ids or a second digest algorithm while staying
#: at half of the 8 KiB per-field limit of aiohttp (``max_field_size`` 8190) and
#: nginx (``large_client_header_buffers``), so parsing cost stays trivially bounded.
MAX_AUTH_FIELD_BYTES: Final = 4096
#: Largest accepted request target (path + query).  aiohttp's default
#: ``max_line_size`` for the whole request line is 8190 bytes; no fedsec route is
#: anywhere near that, and the library matches the URL with a regular expression.
MAX_TARGET_BYTES: Final = 8190
#: Default allowed difference between the signer's and the verifier's clocks.
#: Five minutes is Kerberos' long-standing default (RFC 4120 §1.7 suggests it):
#: loose enough for NTP-less edge machines, tight enough to keep the nonce cache
#: small.
DEFAULT_MAX_SKEW_S: Final = 300.0
#: Default bound on nonces remembered for one key.  The bound is per key so that one
#: key, however fast it sends valid requests, fills only its own share and never
#: locks another out.  One entry costs ~300 bytes; 50 000 entries (~15 MB) is 83
#: requests/s from one key sustained over a 10-minute (2 x skew) window, above the
#: aggregator's per-member rate limit, which is what normally binds.
DEFAULT_NONCES_PER_KEY: Final = 50_000
#: Verification keys a verifier keeps built (~1 KB each with their key ids): above the
#: largest roster fedsec serves from one process (1,000 members and their operators) so
#: that steady traffic never rebuilds one; past it the cache starts over.
MAX_CACHED_KEYS: Final = 16_384
#: Random bytes per nonce: 128 bits make a collision between two honest requests
#: negligible (birthday bound ~2^-64 after 2^32 requests by one key).
NONCE_BYTES: Final = 16

# ------------------------------------------------------------------------ protocol
#: Signature dictionary label.  Labels are not signed; :data:`SIGNATURE_TAG` is.  One
#: letter: it is sent twice on every request and says nothing the tag does not.
SIGNATURE_LABEL: Final = "f"
#: Labels a verifier accepts: :data:`SIGNATURE_LABEL`, and ``fedsec``, which agents
#: signed with before the label was shortened (the label is unsigned: accepting it
#: changes nothing a signature proves).
ACCEPTED_LABELS: Final = frozenset({SIGNATURE_LABEL, "fedsec"})
#: Signed application tag (RFC 9421 §2.3): marks the signature as fedsec's.
SIGNATURE_TAG: Final = "fedsec"
#: RFC 9421 §3.3.6 algorithm identifier.
SIGNATURE_ALG: Final = "ed25519"
#: Components every fedsec signature covers, in signing order (see module doc).
COVERED_COMPONENTS: Final = ("@method", "@path", "@query", "content-digest")
#: Components a fedsec signature of a request without a body covers (see module doc).
BODILESS_COMPONENTS: Final = COVERED_COMPONENTS[:3]
#: Signature parameters a fedsec signature may carry, and no others; ``alg`` is the
#: only optional one (see module doc), the signer leaves it out.
SIGNATURE_PARAMETERS: Final = frozenset({"created", "keyid", "alg", "nonce", "tag"})
#: RFC 9530 digest algorithm; the only one accepted.
DIGEST_ALG: Final = "sha-256"

_ED25519_SIGNATURE_BYTES: Final = 64
_SHA256_BYTES: Final = 32
# A 128-bit nonce is 22 base64url characters; longer (more random) nonces from
# other agent implementations are fine, shorter ones are not.
_NONCE_RE: Final = re.compile(r"[A-Za-z0-9_-]{22,64}")
_KEYID_RE: Final = re.compile(r"ed25519:[0-9a-f]{32}")
# Placeholder origin for a bare path: scheme and authority are not covered, but
# the library resolves components from an absolute URL.
_PLACEHOLDER_ORIGIN: Final = "https://aggregator.invalid"
_AUTH_FIELDS: Final = ("signature-input", "signature", "content-digest")
_FIELD_NAMES: Final = {
    "signature-input": "Signature-Input",
    "signature": "Signature",
    "content-digest": "Content-Digest",
}


# ------------------------------------------------------------------- nonce cache
class NonceStore(Protocol):
    """Where verified ``(keyid, nonce)`` pairs are remembered until their window passes.

    :class:`NonceCache` keeps them in memory; a server that must refuse replays across
    restarts, or across several processes, passes a persistent implementation.
    """

    @property
    def window_s(self) -> float:
        """Seconds after ``created`` that a nonce is remembered."""
        ...

    def seen(self, keyid: str, nonce: str, now: float) -> bool:
        """Whether ``nonce`` from ``keyid`` is remembered and its window has not passed."""
        ...

    def remember(self, keyid: str, nonce: str, created: int, now: float) -> None:
        """Record a verified request's nonce until ``created + window_s``.

        Raises:
            ReplayError: the nonce is already remembered, the request is outside
                the window, or the store refuses to hold more for this key.
        """
        ...


class NonceCache:
    """Remembers ``(keyid, nonce)`` pairs in memory until ``created + window_s`` has passed.

    Memory is bounded per key by ``max_per_key``.  When a key's share is full,
    entries whose time has passed are evicted, oldest-expiring first; if every
    entry of that key is still live its *new* request is refused with
    :class:`ReplayError` rather than forgetting a live nonce, because forgetting
    one would let that request be replayed.  The refusal is temporary (entries
    expire within ``window_s``), touches only the key that sent too much, and only
    signed requests ever reach the cache.

    Times are passed in (``now``) so the cache does no I/O and is testable.  Not
    thread-safe: give each worker its own verifier or hold a lock around
    :meth:`RequestVerifier.verify`.  Cost: ``seen`` O(1), ``remember`` O(log n)
    amortised.
    """

    __slots__ = ("_expiry", "_heap", "_per_key", "_window_s", "max_per_key")

    def __init__(self, window_s: float, max_per_key: int = DEFAULT_NONCES_PER_KEY) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"nonce window must be a positive number of seconds, got {window_s}")
        if max_per_key < 1:
            raise ValueError(f"nonce cache must hold at least one entry a key, got {max_per_key}")
        self._window_s = float(window_s)
        self.max_per_key = int(max_per_key)
        self._expiry: dict[tuple[str, str], float] = {}
        self._per_key: dict[str, int] = {}
        self._heap: list[tuple[float, str, str]] = []

    @property
    def window_s(self) -> float:
        return self._window_s

    def __len__(self) -> int:
        return len(self._expiry)

    def seen(self, keyid: str, nonce: str, now: float) -> bool:
        """Whether ``nonce`` from ``keyid`` is remembered and its window has not passed."""
        expiry = self._expiry.get((keyid, nonce))
        return expiry is not None and now <= expiry

    def remember(self, keyid: str, nonce: str, created: int, now: float) -> None:
        """Record a verified request's nonce until ``created + window_s``.

        Raises:
            ReplayError: the nonce is already remembered ("replayed nonce"); the
                request is already outside the window ("stale timestamp"); or this
                key's share of the cache is full of live entries.
        """
        expiry = created + self._window_s
        if expiry < now:
            raise ReplayError(
                f"stale timestamp: a request created at {created} is older than the "
                f"{self._window_s:g} s replay window"
            )
        self._evict_expired(now)
        if self.seen(keyid, nonce, now):
            raise ReplayError(
                f"replayed nonce: {keyid} already used nonce {nonce!r} within the last "
                f"{self._window_s:g} s"
            )
        held = self._per_key.get(keyid, 0)
        if held >= self.max_per_key:
            raise ReplayError(
                f"nonce quota full: {keyid} has {held} requests still inside the "
                f"{self._window_s:g} s replay window; refusing this one rather than "
                "forgetting a nonce; retry shortly"
            )
        self._expiry[(keyid, nonce)] = expiry
        self._per_key[keyid] = held + 1
        heapq.heappush(self._heap, (expiry, keyid, nonce))

    def _evict_expired(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            expiry, keyid, nonce = heapq.heappop(self._heap)
            if self._expiry.get((keyid, nonce)) == expiry:
                del self._expiry[(keyid, nonce)]
                left = self._per_key[keyid] - 1
                if left:
                    self._per_key[keyid] = left
                else:
                    del self._per_key[keyid]


# ------------------------------------------------------- adapters to the library
@dataclass
class _RequestView:
    """The requests-like object the library reads: method, absolute URL, headers."""

    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------ signing
def sign_request(
    identity: SigningIdentity,
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    created: int | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """Sign an agent request (RFC 9421, Ed25519).

    Args:
        identity: the agent's signing identity; its key id becomes ``keyid``.
        method: HTTP method, uppercase, exactly as sent.
        url: absolute URL or path (with query), percent-encoded exactly as it will
            go on the wire (the aggregator verifies the raw path it receives).
        headers: the request's other headers; they must not already hold
            ``Content-Digest``, ``Signature-Input`` or ``Signature``.
        body: the exact body bytes (``b""`` when there is none).
        created: signature creation time, Unix seconds; defaults to now.
        nonce: base64url nonce of at least 128 bits; defaults to a fresh random one.
            Only tests should pass one.

    Returns:
        The headers to add: ``Signature-Input``, ``Signature`` and, unless ``body`` is
        empty, ``Content-Digest``.

    Raises:
        ValueError: a malformed method, URL or nonce, or conflicting headers.
    """
    if not method or method != method.upper() or not method.isascii():
        raise ValueError(f"HTTP method must be an uppercase ASCII token, got {method!r}")
    for name in headers:
        if name.lower() in _AUTH_FIELDS:
            raise ValueError(f"headers already contain {name}; sign_request sets it")
    if nonce is None:
        nonce = secrets.token_urlsafe(NONCE_BYTES)
    elif not _NONCE_RE.fullmatch(nonce):
        raise ValueError("nonce must be 22 to 64 base64url characters (at least 128 bits)")
    if created is None:
        created = int(time.time())
    view = _RequestView(method=method, url=_absolute_url(url, ValueError))
    signer = HTTPMessageSigner(signature_algorithm=algorithms.ED25519)
    try:
        prepared = signer.prepare(
            view,
            key_id=identity.key_id,
            created=datetime.datetime.fromtimestamp(created, tz=datetime.UTC),
            nonce=nonce,
            label=SIGNATURE_LABEL,
            tag=SIGNATURE_TAG,
            include_alg=False,
            covered_component_ids=COVERED_COMPONENTS if body else BODILESS_COMPONENTS,
            body=body or None,
        )
    except HTTPMessageSignaturesException as exc:
        raise ValueError(f"cannot sign {method} {url}: {exc}") from exc
    signature = _sign_signature_base(identity, prepared.signature_base)
    # prepare() has built the signature base and validated every component, parameter
    # and the label.  The library's apply() would resolve all components again, to catch
    # a message changed while an external signer worked: ``view`` is private to this
    # call and cannot change, and that second pass was ~40 % of an agent's signing time.
    # Both fields are one-member Structured Field Dictionaries (RFC 8941 §3.2): the label
    # with the serialized inner list, and with the signature as a Byte Sequence (§3.3.5).
    view.headers["Signature-Input"] = f"{prepared.label}={prepared.signature_params}"
    view.headers["Signature"] = f"{prepared.label}=:{base64.b64encode(signature).decode()}:"
    added = {_FIELD_NAMES[name.lower()]: value for name, value in view.headers.items()}
    for name, value in added.items():
        # The verifier would refuse anything larger; fail here, at the source.
        if len(value) > MAX_AUTH_FIELD_BYTES:
            raise ValueError(f"{name} would be {len(value)} bytes, over {MAX_AUTH_FIELD_BYTES}")
    return added


def _sign_signature_base(identity: SigningIdentity, signature_base: bytes) -> bytes:
    """Plain Ed25519 over an RFC 9421 signature base, as the ``ed25519`` algorithm
    (RFC 9421 §3.3.6) requires."""
    return identity.sign_http_signature_base(signature_base)


# ------------------------------------------------------------------- verification
class _SignatureClaims(NamedTuple):
    """What a request's Signature-Input and Signature headers say, syntax-checked.

    A named tuple rather than a frozen dataclass: one is built per request, and a frozen
    dataclass's constructor costs several times a tuple's."""

    components: tuple[str, ...]
    created: int
    keyid: str
    alg: str | None
    nonce: str | None
    tag: str | None
    signature: bytes
    #: the signature parameters as received, in order (RFC 9421 §2.3 signs them so)
    parameters: tuple[tuple[str, int | str], ...]
    #: the value of ``@signature-params`` in the signature base: the inner list and its
    #: parameters in RFC 8941's canonical serialization (RFC 9421 §2.3)
    signature_params: str


@dataclass(frozen=True)
class SignedHeaders:
    """A request whose signature verified over its method, target and headers; the body
    is still to be checked against ``digest`` by :meth:`RequestVerifier.verify_body`."""

    keyid: str
    nonce: str
    created: int
    digest: bytes | None  # None: signed as a request without a body


class RequestVerifier:
    """Verifies signed agent requests for the aggregator (sans-I/O).

    Args:
        resolve_key: maps a key id to the 32-byte Ed25519 public key of an enrolled,
            non-revoked agent, or ``None``.  The key id must be that key's
            fingerprint (:func:`fedsec.crypto.identity.key_id`).
        nonce_cache: where verified nonces are remembered; its ``window_s`` must be
            at least ``max_skew_s`` so a nonce outlives every moment its request
            could still be accepted.
        max_skew_s: largest accepted ``|now - created|``, seconds.
        clock: Unix time source.
    """

    def __init__(
        self,
        resolve_key: Callable[[str], bytes | None],
        nonce_cache: NonceStore,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (math.isfinite(max_skew_s) and max_skew_s > 0):
            raise ValueError(f"max_skew_s must be a positive number of seconds, got {max_skew_s}")
        if nonce_cache.window_s < max_skew_s:
            raise ValueError(
                f"nonce cache window ({nonce_cache.window_s:g} s) is shorter than the clock "
                f"skew window ({max_skew_s:g} s): a request could be replayed after its "
                "nonce is forgotten"
            )
        self._resolve_key = resolve_key
        self._nonces = nonce_cache
        self._max_skew_s = float(max_skew_s)
        self._clock = clock
        # Verification keys by public key bytes: building one (and its fingerprint) on
        # every request cost more than a tenth of the Ed25519 check.  Keyed by the bytes
        # the resolver returns now, so a revoked or replaced key is never served from here.
        self._keys: dict[bytes, tuple[str, PublicIdentity]] = {}

    def verify(self, method: str, url_or_path: str, headers: Mapping[str, str], body: bytes) -> str:
        """Authenticate one request and record its nonce.

        Args:
            method: the request method as received.
            url_or_path: the raw (still percent-encoded) path and query as received,
                e.g. aiohttp's ``request.raw_path``, or an absolute URL.
            headers: all request headers; a multi-valued mapping (aiohttp's
                ``CIMultiDictProxy``) is fine, repeated authentication fields are
                refused.
            body: the exact body bytes received.

        Returns:
            The verified key id (``"ed25519:<32 hex>"``).

        Raises:
            PayloadError: see :meth:`verify_headers`.
            AuthError: see :meth:`verify_headers` and :meth:`verify_body`.
            ReplayError: see :meth:`verify_headers` and :meth:`verify_body`.
        """
        return self.verify_body(self.verify_headers(method, url_or_path, headers), body)

    def verify_headers(
        self, method: str, url_or_path: str, headers: Mapping[str, str]
    ) -> SignedHeaders:
        """Steps 1-6 of the module doc: everything that needs no body.  Records nothing.

        Args:
            method: the request method as received.
            url_or_path: the raw (still percent-encoded) path and query as received.
            headers: all request headers (repeated authentication fields are refused).

        Returns:
            The verified claims, to be completed by :meth:`verify_body`.

        Raises:
            PayloadError: an authentication field is oversized, repeated or
                malformed, or the method or target is malformed.
            AuthError: a field is missing, the signature does not cover what fedsec
                requires, uses another algorithm or tag, names an unknown or revoked
                key, or does not verify.
            ClockSkewError: ``created`` is outside the skew window.
            ReplayError: the nonce is missing or already used.
        """
        fields = _authentication_fields(headers)
        if not method or method != method.upper() or not method.isascii():
            raise PayloadError(f"HTTP method must be an uppercase ASCII token, got {method[:16]!r}")
        derived = _derived_components(method, url_or_path)
        claims = _parse_signature_fields(fields)
        _check_policy(claims, "content-digest" in fields)
        claimed_digest = (
            _parse_content_digest(fields["content-digest"]) if "content-digest" in fields else None
        )
        now = self._clock()
        self._check_created(claims.created, now)
        assert claims.nonce is not None  # _check_policy guarantees it
        if self._nonces.seen(claims.keyid, claims.nonce, now):
            raise ReplayError(
                f"replayed nonce: {claims.keyid} already used nonce {claims.nonce!r} within the "
                f"last {self._nonces.window_s:g} s"
            )

        public_bytes = self._resolve_key(claims.keyid)
        if public_bytes is None:
            raise AuthError(f"unknown or revoked key {claims.keyid}: it is not on the roster")
        fingerprint, public = self._public_identity(public_bytes)
        if fingerprint != claims.keyid:
            raise AuthError(
                f"key resolver returned a key whose fingerprint is {fingerprint}, "
                f"not the signed keyid {claims.keyid}"
            )
        base = _signature_base(claims, derived, fields)
        if not public.verify_http_signature_base(base, claims.signature):
            raise AuthError(
                f"bad signature: the signature by {claims.keyid} does not verify over this "
                "request's method, path, query and Content-Digest if any (Ed25519 verification "
                "failed)"
            )
        return SignedHeaders(
            keyid=claims.keyid, nonce=claims.nonce, created=claims.created, digest=claimed_digest
        )

    def _public_identity(self, public_bytes: bytes) -> tuple[str, PublicIdentity]:
        """The key id and verification key of ``public_bytes``, built once per key.

        Raises:
            AuthError: the resolver returned something that is not an Ed25519 public key.
        """
        known = self._keys.get(public_bytes)
        if known is None:
            try:
                public = PublicIdentity(public_bytes)
            except SignatureError as exc:
                raise AuthError(f"key resolver returned no Ed25519 public key: {exc}") from None
            if len(self._keys) >= MAX_CACHED_KEYS:
                self._keys.clear()  # rare (a roster past the bound): rebuilt as requests come
            known = self._keys[public_bytes] = (public.key_id, public)
        return known

    def verify_body(self, signed: SignedHeaders, body: bytes) -> str:
        """Steps 7-8 of the module doc: the body against the signed digest (no body when
        none was signed), then the nonce.

        Args:
            signed: what :meth:`verify_headers` returned for this request.
            body: the exact body bytes received.

        Returns:
            The verified key id.

        Raises:
            AuthError: the body does not match the signed Content-Digest, or there is a
                body and the signature covers none.
            ReplayError: the nonce was recorded meanwhile (a concurrent replay), the
                request has left the window, or the nonce store refuses it.
        """
        if signed.digest is None:
            if body:
                raise AuthError(
                    "unsigned body: the signature covers no Content-Digest, so the request "
                    f"must have no body, but {len(body)} bytes came"
                )
        elif not hmac.compare_digest(signed.digest, hashlib.sha256(body).digest()):
            raise AuthError(
                "content digest mismatch: the body's sha-256 does not match the signed "
                "Content-Digest (the body was altered or truncated)"
            )
        self._nonces.remember(signed.keyid, signed.nonce, signed.created, self._clock())
        return signed.keyid

    def _check_created(self, created: int, now: float) -> None:
        age = now - created
        if age > self._max_skew_s:
            raise ClockSkewError(
                f"stale timestamp: the signature was created {age:.0f} s ago, more than the "
                f"{self._max_skew_s:g} s allowed"
            )
        if -age > self._max_skew_s:
            raise ClockSkewError(
                f"stale timestamp: the signature was created {-age:.0f} s in the future, more "
                f"than the {self._max_skew_s:g} s clock skew allowed"
            )


def _authentication_fields(headers: Mapping[str, str]) -> dict[str, str]:
    """The three authentication fields, each present once and size-checked, by lowercase name."""
    found: dict[str, str] = {}
    for name, value in headers.items():
        lname = name.lower()
        if lname not in _AUTH_FIELDS:
            continue
        if lname in found:
            raise PayloadError(f"{_FIELD_NAMES[lname]} header appears more than once")
        if len(value) > MAX_AUTH_FIELD_BYTES:
            raise PayloadError(
                f"{_FIELD_NAMES[lname]} header is {len(value)} bytes, over the "
                f"{MAX_AUTH_FIELD_BYTES}-byte limit"
            )
        if not value.isascii():
            raise PayloadError(f"{_FIELD_NAMES[lname]} header contains non-ASCII characters")
        found[lname] = value.strip(" \t")
    for lname in ("signature-input", "signature"):
        if lname not in found:
            raise AuthError(
                f"missing {_FIELD_NAMES[lname]} header: fedsec requests must be signed "
                "(RFC 9421), with a Content-Digest (RFC 9530) when they have a body"
            )
    return found


def _absolute_url(url_or_path: str, error: type[Exception]) -> str:
    if len(url_or_path) > MAX_TARGET_BYTES:
        raise error(f"request target is {len(url_or_path)} bytes, over {MAX_TARGET_BYTES}")
    if url_or_path.startswith("/"):
        return _PLACEHOLDER_ORIGIN + url_or_path
    if url_or_path.startswith(("https://", "http://")):
        return url_or_path
    raise error("request target must be a path starting with '/' or an http(s) URL")


def _reject_duplicate(key: str, context: str) -> None:
    raise ValueError(f"duplicate key {key!r} in {context}")


def _parse_dictionary(fields: Mapping[str, str], lname: str) -> dict[str, object]:
    """The field as an RFC 8941 Dictionary, in ``http_sf``'s shape.

    Raises:
        PayloadError: the field is not a Dictionary (or repeats a key).
    """
    value = fields[lname]
    fast = _one_member_dictionary(value)
    if fast is not None:
        return fast
    try:
        parsed = http_sf.parse(
            value.encode("ascii"), tltype="dictionary", on_duplicate_key=_reject_duplicate
        )
    except ValueError as exc:
        raise PayloadError(f"malformed {_FIELD_NAMES[lname]} header: {exc}") from None
    assert isinstance(parsed, dict)
    return dict(parsed)


# The one-member Dictionaries fedsec's signer and every plain RFC 9421 signer send, in
# RFC 8941's canonical serialization: a key, then a byte sequence or an inner list of
# strings with integer or string parameters.  Each pattern admits only a subset of
# RFC 8941 (no whitespace, escapes, tokens, booleans, member parameters or second
# member); whatever it matches, ``http_sf`` parses to the same value (a property test
# holds the two to that), and whatever it does not match goes to ``http_sf``, which
# accepts or refuses it as before.  Parsing this way is ~20 times cheaper than
# ``http_sf``'s general parser, which was the largest cost of an aggregator request.
_SF_KEY: Final = r"[a-z*][a-z0-9_.*-]*"
_SF_STRING: Final = r'"[ !#-\[\]-~]*"'  # printable ASCII but '"' and backslash: no escapes
_SF_INTEGER: Final = r"-?[0-9]{1,15}"
_SF_BYTES_MEMBER: Final = re.compile(rf"({_SF_KEY})=:([A-Za-z0-9+/]*={{0,2}}):")
_SF_INNER_LIST_MEMBER: Final = re.compile(
    rf"({_SF_KEY})=\(((?:{_SF_STRING}(?: {_SF_STRING})*)?)\)"
    rf"((?:;{_SF_KEY}=(?:{_SF_INTEGER}|{_SF_STRING}))*)"
)
_SF_STRING_CONTENT: Final = re.compile(r'"([^"]*)"')
_SF_PARAMETER: Final = re.compile(rf';({_SF_KEY})=(?:({_SF_INTEGER})|"([^"]*)")')


def _one_member_dictionary(value: str) -> dict[str, object] | None:
    """``value`` parsed as ``http_sf`` would, if it is one canonical member; else None."""
    if match := _SF_BYTES_MEMBER.fullmatch(value):
        text = match[2]
        try:
            decoded = base64.b64decode(text, validate=True)
        except ValueError:
            return None
        # canonical only: padding and unused bits exactly as an encoder writes them
        if base64.b64encode(decoded).decode() != text:
            return None
        return {match[1]: (decoded, {})}
    if match := _SF_INNER_LIST_MEMBER.fullmatch(value):
        # not split(" "): a string may hold spaces; none holds a quote
        items: list[tuple[str, dict[str, object]]] = [
            (item, {}) for item in _SF_STRING_CONTENT.findall(match[2])
        ]
        params: dict[str, object] = {}
        for param in _SF_PARAMETER.finditer(match[3]):
            if param[1] in params:
                return None  # a repeated key: http_sf names the refusal
            params[param[1]] = int(param[2]) if param[2] is not None else param[3]
        return {match[1]: (items, params)}
    return None


# The Signature-Input and Signature fedsec's own signer writes (:func:`sign_request`),
# byte for byte: label ``f``, the covered components in signing order, then created,
# keyid, nonce and tag, every value in RFC 8941's canonical serialization (no leading
# zeros, no escapes), and 64 bytes of canonical base64 (the last character before the
# padding leaves its 4 unused bits zero: A, Q, g or w).  A pair of fields of exactly
# this shape is read here, by two regular expressions, into the claims the general
# parser below reads from it; the received inner list is then its own canonical
# serialization, so it is the signature base's ``@signature-params`` as received.
# Anything else, however close, goes to the general parser, which accepts or refuses
# it as before.  A property test holds the two to the same claims on mutated fields:
# a difference would be a parser differential.
_FEDSEC_INPUT: Final = re.compile(
    r'f=(\("@method" "@path" "@query"( "content-digest")?\);created=(0|[1-9][0-9]{0,14})'
    r';keyid="(ed25519:[0-9a-f]{32})";nonce="([A-Za-z0-9_-]{22,64})";tag="fedsec")'
)
_FEDSEC_SIGNATURE: Final = re.compile(r"f=:([A-Za-z0-9+/]{85}[AQgw]==):")


def _fedsec_signature_fields(fields: Mapping[str, str]) -> _SignatureClaims | None:
    """The claims of fields of exactly the shape fedsec's signer writes, as
    :func:`_parse_general_signature_fields` reads them; None for any other shape."""
    if (given := _FEDSEC_INPUT.fullmatch(fields["signature-input"])) is None:
        return None
    if (signature := _FEDSEC_SIGNATURE.fullmatch(fields["signature"])) is None:
        return None
    created, keyid, nonce = int(given[3]), given[4], given[5]
    return _SignatureClaims(
        components=COVERED_COMPONENTS if given[2] else BODILESS_COMPONENTS,
        created=created,
        keyid=keyid,
        alg=None,
        nonce=nonce,
        tag=SIGNATURE_TAG,
        signature=binascii.a2b_base64(signature[1], strict_mode=True),
        parameters=(
            ("created", created),
            ("keyid", keyid),
            ("nonce", nonce),
            ("tag", SIGNATURE_TAG),
        ),
        signature_params=given[1],
    )


def _parse_signature_fields(fields: Mapping[str, str]) -> _SignatureClaims:
    """What the Signature-Input and Signature fields say (step 2 of the module doc).

    Raises:
        PayloadError: a field is malformed or holds another signature than one labelled
            as fedsec's.
        AuthError: a covered component carries parameters, or the signature carries an
            unexpected parameter.
    """
    return _fedsec_signature_fields(fields) or _parse_general_signature_fields(fields)


def _parse_general_signature_fields(fields: Mapping[str, str]) -> _SignatureClaims:
    """:func:`_parse_signature_fields` for whatever shape RFC 8941 and RFC 9421 allow.

    Raises:
        PayloadError, AuthError: as :func:`_parse_signature_fields`.
    """
    inputs = _parse_dictionary(fields, "signature-input")
    signatures = _parse_dictionary(fields, "signature")
    label = next(iter(inputs), "")
    if not (set(inputs) == set(signatures) == {label} and label in ACCEPTED_LABELS):
        raise PayloadError(
            f"Signature-Input and Signature must each hold exactly one signature labelled "
            f"{SIGNATURE_LABEL!r}, got {sorted(inputs)[:4]} and {sorted(signatures)[:4]}"
        )
    member = inputs[label]
    if not (isinstance(member, tuple) and isinstance(member[0], list)):
        raise PayloadError("Signature-Input member must be an inner list of covered components")
    items, params = member[0], member[1]
    components: list[str] = []
    for item in items:
        if not (isinstance(item, tuple) and type(item[0]) is str):
            raise PayloadError("Signature-Input components must be quoted strings")
        if item[1]:
            raise AuthError(
                f"covered component {item[0]!r} carries parameters; fedsec signs plain components"
            )
        components.append(item[0])
    if len(set(components)) != len(components):
        raise PayloadError("Signature-Input covers a component more than once")

    unexpected = sorted(set(params) - SIGNATURE_PARAMETERS)
    if unexpected:
        raise AuthError(f"unexpected signature parameter(s) {unexpected}")
    created, keyid = params.get("created"), params.get("keyid")
    if type(created) is not int:
        raise PayloadError("signature parameter 'created' must be an integer Unix time")
    if not (isinstance(keyid, str) and _KEYID_RE.fullmatch(keyid)):
        raise PayloadError("signature parameter 'keyid' must be 'ed25519:' and 32 hex digits")
    text: dict[str, str | None] = {}
    for name in ("alg", "nonce", "tag"):
        value = params.get(name)
        if value is not None and type(value) is not str:
            raise PayloadError(f"signature parameter {name!r} must be a string")
        text[name] = value

    signature = signatures[label]
    if not (isinstance(signature, tuple) and isinstance(signature[0], bytes)):
        raise PayloadError("Signature member must be a byte sequence (:base64:)")
    if len(signature[0]) != _ED25519_SIGNATURE_BYTES:
        raise PayloadError(
            f"an Ed25519 signature is {_ED25519_SIGNATURE_BYTES} bytes, got {len(signature[0])}"
        )
    parameters = tuple((name, value) for name, value in params.items())
    covered = " ".join(f'"{component}"' for component in components)
    serialized = "".join(f";{name}={_sf_bare_item(value)}" for name, value in parameters)
    return _SignatureClaims(
        components=tuple(components),
        created=created,
        keyid=keyid,
        alg=text["alg"],
        nonce=text["nonce"],
        tag=text["tag"],
        signature=signature[0],
        parameters=parameters,
        signature_params=f"({covered}){serialized}",
    )


def _check_policy(claims: _SignatureClaims, has_digest: bool) -> None:
    """What the signature must say, before any key is looked up; ``has_digest``: the
    request carries a ``Content-Digest`` field."""
    if "content-digest" in claims.components and not has_digest:
        raise AuthError(
            "missing Content-Digest header: the signature covers content-digest (RFC 9530)"
        )
    if has_digest and "content-digest" not in claims.components:
        raise AuthError(
            "signature does not cover required component 'content-digest': a request "
            "that sends a Content-Digest must sign it (only one without a body may omit both)"
        )
    required = COVERED_COMPONENTS if has_digest else BODILESS_COMPONENTS
    if claims.components != required:  # another order is fine: what is covered counts
        _check_components(claims.components, required)
    if claims.alg is not None and claims.alg != SIGNATURE_ALG:
        raise AuthError(f"wrong alg {claims.alg!r}: fedsec signatures use alg={SIGNATURE_ALG!r}")
    if claims.tag != SIGNATURE_TAG:
        raise AuthError(f"wrong tag {claims.tag!r}: fedsec signatures carry tag={SIGNATURE_TAG!r}")
    if claims.nonce is None:
        raise ReplayError(
            "missing nonce: the signature has no nonce parameter, so a replay cannot be ruled out"
        )
    if not _NONCE_RE.fullmatch(claims.nonce):
        raise PayloadError("signature nonce must be 22 to 64 base64url characters (>= 128 bits)")


def _check_components(components: tuple[str, ...], required: tuple[str, ...]) -> None:
    """That ``components`` (no repeats: the parser refuses them) are ``required``, in any order.

    Raises:
        AuthError: a required component is not covered, or another one is.
    """
    for component in required:
        if component not in components:
            raise AuthError(
                f"signature does not cover required component {component!r}; fedsec "
                f"signatures cover {', '.join(required)}"
            )
    extra = [c for c in components if c not in required]
    if extra:
        raise AuthError(
            f"signature covers unexpected component(s) {extra}; fedsec signatures cover "
            f"exactly {', '.join(required)}"
        )


def _signature_base(
    claims: _SignatureClaims, derived: Mapping[str, str], fields: Mapping[str, str]
) -> bytes:
    """The RFC 9421 §2.5 signature base of a request whose ``claims`` passed
    :func:`_check_policy`: each covered component's value, in the signed order, then
    ``@signature-params`` serialized from the parsed claims (RFC 8941 §4.1).

    Built here rather than by the library, whose general path re-parses both fields and
    re-serializes every parameter through ``http_sf`` (~4 times the Ed25519 check's own
    cost); the parameters' serialization is the parser's (``claims.signature_params``),
    ``derived`` holds the derived components' values as the library resolves them
    (:func:`_derived_components`), and the same checks of the values as the library's
    apply.  A test holds it to the library's base.

    Raises:
        AuthError: a component value the signature base may not hold.
    """
    lines = []
    for component in claims.components:
        if component == "content-digest":
            value = fields["content-digest"]
            printable = value.replace("\t", " ").isprintable()
        else:
            value = derived[component]
            printable = value.isprintable() and value == value.strip(" ")
        if not (printable and value.isascii()):
            raise AuthError(
                f"bad signature: component {component!r} holds a value a signature base may "
                "not (control characters, surrounding spaces or non-ASCII)"
            )
        lines.append(f'"{component}": {value}\n')
    lines.append(f'"@signature-params": {claims.signature_params}')
    return "".join(lines).encode("ascii")


# RFC 3986's path-absolute and query grammar, as the library's URL parser spells them
# (``http_message_signatures._url``): a request target of this shape is resolved here,
# ~10 times cheaper than the library's resolver (an absolute-URL parse and a header
# dictionary per request); anything else (an absolute URL, a fragment, a character
# outside the grammar) goes to the library, which resolves or refuses it as before.  A
# property test holds the two to the same values.
_PCHARS: Final = r"A-Za-z0-9._~!$&'()*+,;=:@/\-"
_PATH_AND_QUERY: Final = re.compile(
    rf"(/(?:[{_PCHARS}]|%[0-9A-Fa-f]{{2}})*)(?:\?((?:[{_PCHARS}?]|%[0-9A-Fa-f]{{2}})*))?"
)


def _derived_components(method: str, url_or_path: str) -> dict[str, str]:
    """The values of the derived components a fedsec signature may cover, as the
    library's resolver gives them (``@path`` and ``@query`` in their received spelling).

    Raises:
        PayloadError: the method or target is malformed, or the target too long.
    """
    if len(url_or_path) > MAX_TARGET_BYTES:
        raise PayloadError(f"request target is {len(url_or_path)} bytes, over {MAX_TARGET_BYTES}")
    match = _PATH_AND_QUERY.fullmatch(url_or_path)
    if match is not None:
        return {"@method": method, "@path": match[1], "@query": "?" + (match[2] or "")}
    view = _RequestView(method=method, url=_absolute_url(url_or_path, PayloadError))
    try:
        # Validates method and URL syntax; the library leaves __init__ unannotated.
        resolver = HTTPSignatureComponentResolver(view)  # type: ignore[no-untyped-call]
    except HTTPMessageSignaturesException as exc:
        raise PayloadError(f"malformed request target: {exc}") from None
    return {name: derive(resolver) for name, derive in _DERIVED.items()}


#: The derived components a fedsec signature may cover, resolved as the library does.
_DERIVED: Final[dict[str, Callable[[HTTPSignatureComponentResolver], str]]] = {
    "@method": lambda resolver: str(resolver.get_method()),  # type: ignore[no-untyped-call]
    "@path": lambda resolver: str(resolver.get_path()),  # type: ignore[no-untyped-call]
    "@query": lambda resolver: str(resolver.get_query()),  # type: ignore[no-untyped-call]
}


def _sf_bare_item(value: int | str) -> str:
    """An Integer or String parameter value as RFC 8941 §4.1.4/§4.1.6 serializes it."""
    if isinstance(value, int):
        return str(value)
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


# A Content-Digest of exactly the shape fedsec's signer writes: one sha-256 member, 32
# bytes in canonical base64 (the last character before the padding leaves its 2 unused
# bits zero).  Read here; anything else goes to the general parser, which reads the same
# digest from it or refuses it as before (a property test holds the two together).
_FEDSEC_DIGEST: Final = re.compile(r"sha-256=:([A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=):")


def _parse_content_digest(value: str) -> bytes:
    """The sha-256 digest a Content-Digest field claims (RFC 9530).

    Raises:
        PayloadError: the field is malformed, or holds anything but one sha-256 digest.
    """
    if (fedsec := _FEDSEC_DIGEST.fullmatch(value)) is not None:
        return binascii.a2b_base64(fedsec[1], strict_mode=True)
    parsed = _parse_dictionary({"content-digest": value}, "content-digest")
    if set(parsed) != {DIGEST_ALG}:
        raise PayloadError(
            f"Content-Digest must hold exactly one {DIGEST_ALG} digest, got {sorted(parsed)[:4]}"
        )
    member = parsed[DIGEST_ALG]
    if not (isinstance(member, tuple) and isinstance(member[0], bytes)):
        raise PayloadError(f"Content-Digest {DIGEST_ALG} must be a byte sequence (:base64:)")
    if len(member[0]) != _SHA256_BYTES:
        raise PayloadError(f"a {DIGEST_ALG} digest is {_SHA256_BYTES} bytes, got {len(member[0])}")
    return member[0]
