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
from fedsec.errors import AuthError, PayloadError
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


def test_a_method_no_signature_base_may_hold_is_refused() -> None:
    # RFC 9421 §2.5: a derived component's value is printable, without surrounding spaces
    verifier, cache = make_verifier()
    for method in ("POST ", "PO\tST"):
        with refused(cache, AuthError, "bad signature"):
            verifier.verify(method, PATH, signed(), BODY)
