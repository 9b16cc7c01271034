"""The verifier's own parsing of the authentication fields and its own signature base.

Both replace general code (``http_sf``'s parser, the library's signature-base builder)
on every request, so both are held to it: whatever the fast parser accepts, ``http_sf``
parses to the same value; whatever it does not, ``http_sf`` decides as before; and the
library's own verifier accepts a signature over the base this module builds.  A parser
differential is an attack (a header one parser reads differently from the other), so
the properties draw from the neighbourhood of canonical headers: whitespace, escapes,
tokens, repeated keys, long integers and base64 that only a lenient decoder accepts.
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Callable, Iterator
from unittest import mock

import http_sf
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from http_message_signatures import (
    HTTPMessageVerifier,
    HTTPSignatureComponentResolver,
    MappingKeyResolver,
    algorithms,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.crypto import httpsig
from fedsec.crypto.httpsig import COVERED_COMPONENTS, sign_request
from fedsec.errors import AuthError, ClockSkewError, FedsecError, PayloadError
from tests.crypto.test_httpsig import (
    _PATHS,
    ALICE,
    BODY,
    NONCE,
    NOW,
    PATH,
    make_verifier,
    refused,
    signed,
    with_input,
)

# ------------------------------------------------------ the parser against http_sf
_KEY = st.from_regex(r"[a-z*][a-z0-9_.*-]{0,6}", fullmatch=True)
_NEAR_STRING = st.text(alphabet='ab@-" \\\t~é', max_size=6).map(lambda s: f'"{s}"')
_NEAR_INTEGER = st.from_regex(r"-?0{0,2}[0-9]{1,16}(\.[0-9])?", fullmatch=True)
_NEAR_VALUE = st.one_of(_NEAR_STRING, _NEAR_INTEGER, st.sampled_from(["fedsec", "?1", ":AA==:"]))
_SEPARATOR = st.sampled_from(["", "", "", " ", "  ", "\t"])


@st.composite
def _near_inner_list(draw: st.DrawFn) -> str:
    label = draw(st.sampled_from(["f", "fedsec"]) | _KEY)
    items = draw(
        st.lists(_NEAR_STRING | st.sampled_from(['"@method"', "@path", "tok"]), max_size=4)
    )
    between = draw(st.sampled_from([" ", " ", "  ", "\t"]))
    params = draw(st.lists(st.tuples(_KEY, _SEPARATOR, _NEAR_VALUE), max_size=5))
    text = f"{label}=({draw(_SEPARATOR)}{between.join(items)}{draw(_SEPARATOR)})"
    text += "".join(f";{space}{key}={value}" for key, space, value in params)
    if draw(st.booleans()) and draw(st.booleans()):
        text += draw(st.sampled_from([", g=1", ",", " ", ";", ", f=()"]))
    return text


@st.composite
def _near_byte_sequence(draw: st.DrawFn) -> str:
    raw = draw(st.binary(max_size=70))
    text = base64.b64encode(raw).decode()
    edit = draw(st.sampled_from(["none", "strip", "unused-bits", "urlsafe", "space"]))
    if edit == "strip":
        text = text.rstrip("=")
    elif edit == "unused-bits" and text.endswith("="):
        text = text.rstrip("=")[:-1] + "B" + text[len(text.rstrip("=")) :]
    elif edit == "urlsafe":
        text = text.replace("+", "-").replace("/", "_")
    elif edit == "space":
        text = text[: len(text) // 2] + " " + text[len(text) // 2 :]
    label = draw(st.sampled_from(["f", "sha-256", "sha-512"]) | _KEY)
    return f"{label}=:{text}:"


def _http_sf(value: str) -> object:
    return dict(
        http_sf.parse(
            value.encode("ascii"), tltype="dictionary", on_duplicate_key=httpsig._reject_duplicate
        )
    )


@settings(max_examples=150, deadline=None)
@given(value=_near_inner_list() | _near_byte_sequence())
def test_property_the_fast_parser_reads_what_http_sf_reads(value: str) -> None:
    fast = httpsig._one_member_dictionary(value)
    if fast is not None:
        # http_sf must accept it too, and read exactly the same
        assert _http_sf(value) == fast


@pytest.mark.parametrize(
    "value",
    [
        'f=("@method" "@path");created=1700000000;keyid="ed25519:ab";nonce="x";tag="fedsec"',
        'fedsec=("@method");alg="ed25519";created=-0;tag=""',
        "f=();created=0123",
        "f=:" + base64.b64encode(bytes(64)).decode() + ":",
        "sha-256=:" + base64.b64encode(bytes(range(32))).decode() + ":",
        "f=::",
    ],
)
def test_canonical_members_take_the_fast_path(value: str) -> None:
    fast = httpsig._one_member_dictionary(value)
    assert fast is not None
    assert fast == _http_sf(value)


@pytest.mark.parametrize(
    "value",
    [
        'f=("@method");  created=1',  # whitespace RFC 8941 allows after ';'
        'f=( "@method" )',  # and inside an inner list
        'f=("@method");tag="fed\\"sec"',  # an escape
        'f=("@method");tag=fedsec',  # a token
        'f=("@method");created=1;created=2',  # a repeated parameter
        'f=("@method");created=1234567890123456',  # 16 digits: not an Integer
        'f=("@method");x=?1',  # a Boolean
        'f=("@method";x=1)',  # a component with parameters
        'f=("@method"), g=("@path")',  # a second member
        "f=:AAB=:",  # base64 with unused bits set: http_sf's decoder accepts it
        "f=:AAA:",  # unpadded
        "f=:-_8=:",  # the URL-safe alphabet
    ],
)
def test_anything_else_goes_to_http_sf(value: str) -> None:
    assert httpsig._one_member_dictionary(value) is None


# --------------------------- refusals of non-canonical fields are named as before
def test_a_repeated_signature_parameter_is_refused_as_a_duplicate() -> None:
    verifier, cache = make_verifier()
    headers = with_input(signed(), lambda s: s + ';tag="other"')
    with refused(cache, PayloadError, "duplicate key 'tag'"):
        verifier.verify("POST", PATH, headers, BODY)


def test_a_second_signature_smuggled_into_the_input_is_refused() -> None:
    verifier, cache = make_verifier()
    headers = with_input(signed(), lambda s: s + ', g=("@method");tag="fedsec"')
    with refused(cache, PayloadError, "exactly one signature"):
        verifier.verify("POST", PATH, headers, BODY)


def test_an_escaped_or_token_tag_is_refused_as_before() -> None:
    verifier, cache = make_verifier()
    escaped = with_input(signed(), lambda s: s.replace('tag="fedsec"', 'tag="fed\\"sec"'))
    with refused(cache, AuthError, "wrong tag 'fed\"sec'"):
        verifier.verify("POST", PATH, escaped, BODY)
    token = with_input(signed(), lambda s: s.replace('tag="fedsec"', "tag=fedsec"))
    with refused(cache, PayloadError, "'tag' must be a string"):
        verifier.verify("POST", PATH, token, BODY)


def test_an_over_long_created_is_refused_as_malformed() -> None:
    verifier, cache = make_verifier()
    headers = with_input(signed(), lambda s: s.replace(f"created={NOW}", "created=1" + "0" * 15))
    with refused(cache, PayloadError, "malformed Signature-Input"):
        verifier.verify("POST", PATH, headers, BODY)


def test_a_digest_in_lenient_base64_is_read_as_before() -> None:
    # sha-256 digests are 32 bytes: 43 base64 characters and '='; written without the
    # padding, http_sf still reads it, and the signature covers the field as sent
    verifier, cache = make_verifier()
    headers = signed()
    headers["Content-Digest"] = headers["Content-Digest"].removesuffix("=:") + ":"
    assert httpsig._one_member_dictionary(headers["Content-Digest"]) is None
    with refused(cache, AuthError, "bad signature"):  # signed over the padded field
        verifier.verify("POST", PATH, headers, BODY)


def test_a_non_canonical_but_valid_input_still_verifies() -> None:
    # RFC 8941 allows spaces after ';' and inside an inner list; the signature base
    # holds the canonical serialization (RFC 9421 §2.3), so the signature still verifies
    verifier, _ = make_verifier()
    spaced = with_input(signed(), lambda s: s.replace(";", ";  ").replace("(", "( "))
    assert httpsig._one_member_dictionary(spaced["Signature-Input"]) is None
    assert verifier.verify("POST", PATH, spaced, BODY) == ALICE.key_id


# ------------------------------------------------ the signature base against the library
_PARAMETERS = ("created", "keyid", "nonce", "tag")


def _value(name: str) -> str:
    return {
        "created": str(NOW),
        "keyid": f'"{ALICE.key_id}"',
        "nonce": f'"{NONCE}"',
        "tag": '"fedsec"',
        "alg": '"ed25519"',
    }[name]


@settings(max_examples=60, deadline=None)
@given(
    path=_PATHS,
    method=st.sampled_from(["GET", "POST", "PUT"]),
    with_body=st.booleans(),
    with_alg=st.booleans(),
    label=st.sampled_from(sorted(httpsig.ACCEPTED_LABELS)),
    data=st.data(),
)
def test_property_the_signature_base_is_the_librarys(
    path: str, method: str, with_body: bool, with_alg: bool, label: str, data: st.DataObject
) -> None:
    """A signature over the base built here verifies with the library's own verifier,
    whatever order the signer put its components and parameters in."""
    body = BODY if with_body else b""
    covered = COVERED_COMPONENTS if with_body else COVERED_COMPONENTS[:3]
    components = data.draw(st.permutations(covered), label="components")
    names = data.draw(st.permutations(_PARAMETERS + (("alg",) if with_alg else ())))
    headers = sign_request(ALICE, method, path, {}, body, created=NOW, nonce=NONCE)
    inner = " ".join(f'"{c}"' for c in components)
    headers["Signature-Input"] = f"{label}=({inner})" + "".join(f";{n}={_value(n)}" for n in names)
    headers["Signature"] = f"{label}=:{base64.b64encode(bytes(64)).decode()}:"
    fields = httpsig._authentication_fields(headers)
    claims = httpsig._parse_signature_fields(fields)
    base = httpsig._signature_base(claims, httpsig._derived_components(method, path), fields)
    signature = base64.b64encode(ALICE.sign_http_signature_base(base)).decode()
    headers["Signature"] = f"{label}=:{signature}:"

    verifier, _ = make_verifier()
    assert verifier.verify(method, path, headers, body) == ALICE.key_id
    library_view = httpsig._RequestView(method=method, url="https://a.example" + path)
    library_view.headers.update(headers)
    library = HTTPMessageVerifier(
        signature_algorithm=algorithms.ED25519,
        key_resolver=MappingKeyResolver(
            public_keys={ALICE.key_id: Ed25519PublicKey.from_public_bytes(ALICE.public_bytes)},
            private_keys={},
        ),
    )
    (result,) = library.verify(library_view, max_age=None)
    assert result.parameters["nonce"] == NONCE


# A target's characters: the path-and-query grammar's, and its neighbours (a fragment,
# spaces, percent signs without two hex digits, non-ASCII, a bare query).
_TARGET_CHARS = st.sampled_from([*list("az09-._~!$&'()*+,;=:@/?%#AFfg \t\"<>[]^`{|}é"), "%2F"])
_NEAR_TARGETS = st.lists(_TARGET_CHARS, max_size=24).map(lambda chars: "/" + "".join(chars))


@settings(max_examples=300, deadline=None)
@given(target=_PATHS | _NEAR_TARGETS, method=st.sampled_from(["GET", "POST"]))
def test_property_derived_components_are_the_librarys(target: str, method: str) -> None:
    """The verifier resolves a path-and-query target itself: to the values the library's
    resolver gives, and whatever the library refuses is refused."""
    view = httpsig._RequestView(method=method, url="https://aggregator.invalid" + target)
    try:
        resolver = HTTPSignatureComponentResolver(view)  # type: ignore[no-untyped-call]
    except Exception:
        with pytest.raises(PayloadError, match="malformed request target"):
            httpsig._derived_components(method, target)
        return
    assert httpsig._derived_components(method, target) == {
        "@method": method,
        "@path": resolver.get_path(),  # type: ignore[no-untyped-call]
        "@query": resolver.get_query(),  # type: ignore[no-untyped-call]
    }


def test_a_signature_over_a_base_with_a_control_character_is_refused_by_name() -> None:
    # signed over the very base the verifier builds, so the check of the values (RFC
    # 9421 §2.5) refuses it, not the Ed25519 check
    method = "PO\tST"
    headers = signed()
    fields = httpsig._authentication_fields(headers)
    claims = httpsig._parse_signature_fields(fields)
    values = {**httpsig._derived_components("POST", PATH), "@method": method, **fields}
    lines = [f'"{name}": {values[name]}\n' for name in claims.components]
    base = "".join(lines) + f'"@signature-params": {claims.signature_params}'
    signature = ALICE.sign_http_signature_base(base.encode())
    headers["Signature"] = f"f=:{base64.b64encode(signature).decode()}:"
    verifier, cache = make_verifier()
    with refused(cache, AuthError, "holds a value a signature base may not"):
        verifier.verify(method, PATH, headers, BODY)


def test_a_method_no_signature_base_may_hold_is_refused() -> None:
    # RFC 9421 §2.5: a derived component's value is printable, without surrounding spaces
    verifier, cache = make_verifier()
    for method in ("POST ", "PO\tST"):
        with refused(cache, AuthError, "bad signature"):
            verifier.verify(method, PATH, signed(), BODY)


# -------------------- fedsec's own shape of fields against the general parser
# The verifier reads fields of exactly the shape fedsec's signer writes with two regular
# expressions (httpsig._fedsec_signature_fields, the Content-Digest's likewise) and any
# other shape with the general parser above.  A field the two read differently would be
# a parser differential, so the properties mutate fedsec's own fields a few characters at
# a time, towards what a lenient reader might accept: leading zeros, signs, escapes,
# whitespace, reordered or repeated parameters, upper-case hex, a second member, an
# ``alg``, base64 with unused bits set or without its padding.
_EDIT_CHAR_LIST: list[str] = [*'0123456789aAfFzZ "\\\t;=,:()*-_+/.?', '="', ";alg="]
_SPLICE_LIST: list[tuple[str, str]] = [
    ("created=", "created=0"),
    ("created=", "created=-"),
    ("created=", "created=00"),
    ("created=", "created=1"),
    ('tag="fedsec"', "tag=fedsec"),
    ('tag="fedsec"', 'tag="fedsec";tag="fedsec"'),
    ('tag="fedsec"', 'tag="fedsec";alg="ed25519"'),
    ('keyid="ed25519:', 'keyid="ED25519:'),
    ('"@path" "@query"', '"@query" "@path"'),
    (' "content-digest"', ""),
    (")", ' "content-digest")'),
    ("f=(", "fedsec=("),
    ("f=:", "fedsec=:"),
    ("f=:", "g=:"),
    ("==:", "=:"),
    ("==:", ":"),
    ("A==:", "B==:"),
    ("g==:", "h==:"),
    ("w==:", "x==:"),
    (";nonce=", ";  nonce="),
    (")", ";x=1)"),
    ("", ", g=:AAAA:"),
    ("created=", "created=+"),
    ('tag="fedsec"', 'tag="fedsea"'),
    ('tag="fedsec"', 'tag="Fedsec"'),
    ('tag="fedsec"', 'tag="fedsec "'),
    ('nonce="', 'nonce="\\\\'),
    ('nonce="', 'nonce="%'),
    ('nonce="', 'nonce="+'),
    ('keyid="ed25519:', 'keyid="ed25519:\\\\'),
    ("sha-256=", "sha-512="),
    ("sha-256=", "SHA-256="),
    ("sha-256=", "sha-256=:AAAA:, sha-256="),
]
# rewrites of a value inside the field: one hex digit of the key id upper-cased, the
# nonce cut below 128 bits, the inner list's first component renamed
_REWRITE_LIST: list[Callable[[str], str]] = [
    lambda v: re.sub(r'(keyid="ed25519:[0-9]*)([a-f])', lambda m: m[1] + m[2].upper(), v, count=1),
    lambda v: re.sub(r'nonce="([^"]{21})[^"]*"', r'nonce="\1"', v, count=1),
    lambda v: v.replace('"@method"', '"@Method"', 1),
    lambda v: v.replace('"@query"', '"@query-param"', 1),
]


_EDIT_CHARS = st.sampled_from(_EDIT_CHAR_LIST)
_SPLICES = st.sampled_from(_SPLICE_LIST)
_REWRITES = st.sampled_from(_REWRITE_LIST)
_MUTATED_FIELDS = (
    [("Signature-Input",)] * 3 + [("Signature",)] * 2 + [("Signature-Input", "Signature")]
)


@st.composite
def _mutated(draw: st.DrawFn, value: str) -> str:
    for old, new in draw(st.lists(_SPLICES, max_size=2)):
        value = value.replace(old, new, 1) if old else value + new
    for rewrite in draw(st.lists(_REWRITES, max_size=1)):
        value = rewrite(value)
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(value)))
        kind = draw(st.sampled_from(["insert", "delete", "replace"]))
        char = draw(_EDIT_CHARS)
        if kind == "insert":
            value = value[:at] + char + value[at:]
        elif kind == "delete":
            value = value[:at] + value[at + 1 :]
        else:
            value = value[:at] + char + value[at + 1 :]
    return value


def _general_outcome(fields: dict[str, str], read: object) -> object:
    try:
        return read(fields)  # type: ignore[operator]
    except FedsecError as exc:
        return (type(exc), str(exc))


def _without_fast_paths() -> contextlib.AbstractContextManager[object]:
    """The verifier with only the general parser: neither fedsec's shape nor the
    one-member canonical Dictionaries are read by regular expressions."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(httpsig, "_fedsec_signature_fields", lambda _f: None))
    stack.enter_context(mock.patch.object(httpsig, "_FEDSEC_DIGEST", re.compile("(?!)")))
    stack.enter_context(mock.patch.object(httpsig, "_one_member_dictionary", lambda _v: None))
    return stack


@settings(max_examples=250, deadline=None)
@given(
    with_body=st.booleans(),
    created=st.sampled_from(["0", "7", "100000000000000", "999999999999999", "-1"]),
    nonce=st.from_regex(r"[A-Za-z0-9_-]{22,64}", fullmatch=True),
    data=st.data(),
)
def test_property_fedsecs_shape_is_read_as_the_general_parser_reads_it(
    with_body: bool, created: str, nonce: str, data: st.DataObject
) -> None:
    body = BODY if with_body else b""
    headers = sign_request(ALICE, "POST", PATH, {}, body, created=NOW, nonce=nonce)
    if data.draw(st.booleans(), "other created"):  # the extremes of the Integer grammar
        headers["Signature-Input"] = headers["Signature-Input"].replace(str(NOW), created)
    # mostly one field at a time: the fast path reads a pair only if both keep its shape
    for name in data.draw(st.sampled_from(_MUTATED_FIELDS), "mutated"):
        headers[name] = data.draw(_mutated(headers[name]), name)
    try:
        fields = httpsig._authentication_fields(headers)
    except FedsecError:
        return
    fast = httpsig._fedsec_signature_fields(fields)
    general = _general_outcome(fields, httpsig._parse_signature_fields)
    with _without_fast_paths():
        slow = _general_outcome(fields, httpsig._parse_signature_fields)
    # whatever the fast path reads, the general parser reads to the same claims (and so
    # the same signature base); what it does not read, the general parser decides alone
    assert general == slow
    if fast is not None:
        assert fast == slow
        try:  # the policy is one function of the claims, whichever parser read them
            httpsig._check_policy(fast, "content-digest" in fields)
        except FedsecError:
            return
        base = httpsig._signature_base(fast, httpsig._derived_components("POST", PATH), fields)
        assert isinstance(slow, httpsig._SignatureClaims)
        with _without_fast_paths():
            derived = httpsig._derived_components("POST", PATH)
            assert httpsig._signature_base(slow, derived, fields) == base


@settings(max_examples=200, deadline=None)
@given(digest=st.binary(min_size=30, max_size=34), data=st.data())
def test_property_fedsecs_content_digest_is_read_as_the_general_parser_reads_it(
    digest: bytes, data: st.DataObject
) -> None:
    value = data.draw(_mutated(f"sha-256=:{base64.b64encode(digest).decode()}:"), "digest")
    fast = _general_outcome({"v": value}, lambda f: httpsig._parse_content_digest(f["v"]))
    with _without_fast_paths():
        slow = _general_outcome({"v": value}, lambda f: httpsig._parse_content_digest(f["v"]))
    assert fast == slow


@settings(max_examples=150, deadline=None)
@given(with_body=st.booleans(), data=st.data())
def test_property_a_mutated_request_gets_the_same_answer_from_both_readers(
    with_body: bool, data: st.DataObject
) -> None:
    """End to end: the verifier answers a mutated signed request exactly as it would
    with only the general parser: the same key id, or the same refusal, nonce untouched."""
    body = BODY if with_body else b""
    headers = sign_request(ALICE, "POST", PATH, {}, body, created=NOW, nonce=NONCE)
    for name in data.draw(st.sampled_from([*_MUTATED_FIELDS, ("Content-Digest",)]), "mutated"):
        if name in headers:
            headers[name] = data.draw(_mutated(headers[name]), name)
    answers: list[tuple[object, int]] = []
    for general_only in (False, True):
        verifier, cache = make_verifier()
        with _without_fast_paths() if general_only else contextlib.nullcontext():
            try:
                answers.append((verifier.verify("POST", PATH, headers, body), len(cache)))
            except FedsecError as exc:
                answers.append(((type(exc), str(exc)), len(cache)))
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        # each one step off fedsec's shape: the general parser refuses it as before
        (lambda s: s.replace("created=", "created=-"), ClockSkewError, "stale timestamp"),
        (
            lambda s: s.replace('tag="fedsec"', 'tag="fedsec";tag="x"'),
            PayloadError,
            "duplicate key 'tag'",
        ),
        (
            lambda s: s.replace('keyid="ed25519:', 'keyid="ED25519:'),
            PayloadError,
            "'keyid' must be",
        ),
        (lambda s: s.replace("f=(", "fedsec=("), PayloadError, "exactly one signature"),
        (
            lambda s: s.replace('tag="fedsec"', 'tag="fedsec";alg="hmac-sha256"'),
            AuthError,
            "wrong alg",
        ),
        (lambda s: s + ', g=("@method")', PayloadError, "exactly one signature"),
    ],
)
def test_fields_one_step_off_fedsecs_shape_are_refused_by_the_general_parser(
    edit: Callable[[str], str], error: type[FedsecError], match: str
) -> None:
    headers = with_input(signed(), edit)
    assert httpsig._fedsec_signature_fields(httpsig._authentication_fields(headers)) is None
    verifier, cache = make_verifier()
    with refused(cache, error, match):
        verifier.verify("POST", PATH, headers, BODY)


def test_a_created_with_leading_zeros_is_read_by_the_general_parser_and_verifies() -> None:
    # RFC 9421 §2.3: the base holds the canonical serialization, not the field as
    # received, so the fast path (which signs over the received text) must not read it
    headers = with_input(signed(), lambda s: s.replace("created=", "created=00"))
    fields = httpsig._authentication_fields(headers)
    assert httpsig._fedsec_signature_fields(fields) is None
    assert f";created={NOW};" in httpsig._parse_signature_fields(fields).signature_params
    verifier, _ = make_verifier()
    assert verifier.verify("POST", PATH, headers, BODY) == ALICE.key_id


def test_fedsecs_own_fields_take_the_fast_path() -> None:
    for body in (BODY, b""):
        fields = httpsig._authentication_fields(signed(body=body))
        assert httpsig._fedsec_signature_fields(fields) is not None
        assert httpsig._FEDSEC_DIGEST.fullmatch(
            fields.get("content-digest", "sha-256=:" + "A" * 43 + "=:")
        )


def _read_alike(fields: dict[str, str]) -> bool:
    """Whether the fast path reads ``fields``; if it does, that the general parser (with
    and without its canonical one-member reader) reads exactly the same claims."""
    fast = httpsig._fedsec_signature_fields(fields)
    if fast is None:
        return False
    assert _general_outcome(fields, httpsig._parse_general_signature_fields) == fast
    with mock.patch.object(httpsig, "_one_member_dictionary", lambda _v: None):
        assert _general_outcome(fields, httpsig._parse_general_signature_fields) == fast
    return True


def _single_edits(value: str) -> Iterator[str]:
    """Every value one edit away from ``value``: each targeted splice and rewrite, and
    each character of the edit alphabet inserted at or replacing each position, and each
    position deleted."""
    for old, new in _SPLICE_LIST:
        yield value.replace(old, new, 1) if old else value + new
    for rewrite in _REWRITE_LIST:
        yield rewrite(value)
    for at in range(len(value) + 1):
        yield value[:at] + value[at + 1 :]
        for char in _EDIT_CHAR_LIST:
            yield value[:at] + char + value[at:]
            yield value[:at] + char + value[at + 1 :]


@pytest.mark.parametrize("body", [BODY, b""], ids=["with body", "without"])
def test_every_single_edit_of_fedsecs_fields_is_read_alike(body: bytes) -> None:
    """Exhaustive where the property above samples: each field of a signed request edited
    once, every way, the other left as signed."""
    headers = signed(body=body)
    fields = httpsig._authentication_fields(headers)
    read = 0
    for name in ("signature-input", "signature"):
        for edited in _single_edits(fields[name]):
            read += _read_alike({**fields, name: edited})
    assert read > 100  # the edits that keep fedsec's shape (other nonce characters...)


def test_every_single_edit_of_a_content_digest_is_read_alike() -> None:
    value = signed()["Content-Digest"]
    for edited in _single_edits(value):
        fast = _general_outcome({}, lambda _f, v=edited: httpsig._parse_content_digest(v))
        with mock.patch.object(httpsig, "_FEDSEC_DIGEST", re.compile("(?!)")):
            assert (
                _general_outcome({}, lambda _f, v=edited: httpsig._parse_content_digest(v)) == fast
            )
