"""The custodian's directory: its identity, the federation's key pair, its manifest, and
its append-only log of decisions.

Layout (``fedsec custodian init --dir C``)::

    C/identity.key      Ed25519 secret key (0600)       fedsec.keys
    C/identity.pub      its public key, hex               handed to the consortium admin
    C/he-secret.ctx     TenSEAL context with the secret key (0600, written atomically)
    C/he-public.ctx     the public context (no secret key) it publishes
    C/custodian.json    federation id, CKKS parameters, SHA-256 of he-public.ctx
    C/decryptions.jsonl every decision, released or refused (append-only, hash-chained)

The secret context is refused on loading when group or others may read it, as
:mod:`fedsec.keys` refuses a secret key: a key others could read must be treated as
leaked.  Each decision line carries the SHA-256 of the line before it, so a line removed
or edited later is visible to whoever reads the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from fedsec.crypto import he
from fedsec.crypto.identity import SigningIdentity
from fedsec.custodian.check import DECRYPTION_REASONS, Refused, Release, Released
from fedsec.errors import ConfigError, IntegrityError, KeyFileError
from fedsec.fsio import atomic_write, fsync_dir
from fedsec.keys import load_identity, load_public_key, save_identity, save_public_key
from fedsec.protocol.wire import HeSumOffer

__all__ = [
    "CustodianDir",
    "CustodianManifest",
    "Decision",
    "DecisionLog",
    "create_custodian",
    "open_custodian",
]

IDENTITY_KEY: Final = "identity.key"
IDENTITY_PUB: Final = "identity.pub"
SECRET_CONTEXT: Final = "he-secret.ctx"
PUBLIC_CONTEXT: Final = "he-public.ctx"
MANIFEST: Final = "custodian.json"
DECISIONS: Final = "decryptions.jsonl"
#: The directory holds the secret key: only its owner may list or enter it.
_DIR_MODE: Final = 0o700
_FIRST_PREV: Final = "0" * 64


class CustodianManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``custodian.json``: what the key pair in the directory is for."""

    federation_id: str
    poly_modulus_degree: int
    coeff_mod_bit_sizes: list[int]
    scale_bits: int
    context_sha256: str
    public_key: str  # hex Ed25519 of identity.key
    created: float

    @property
    def params(self) -> he.HeParams:
        return he.HeParams(
            self.poly_modulus_degree, tuple(self.coeff_mod_bit_sizes), self.scale_bits
        )


@dataclass(frozen=True)
class CustodianDir:
    """An opened custodian directory (:func:`open_custodian`)."""

    path: Path
    manifest: CustodianManifest
    identity: SigningIdentity
    public_context: bytes
    secret_context: bytes

    @property
    def decisions(self) -> DecisionLog:
        return DecisionLog(self.path / DECISIONS)


def create_custodian(directory: Path, federation_id: str, params: he.HeParams) -> CustodianManifest:
    """Make a fresh identity and CKKS key pair in ``directory``.

    Raises:
        ConfigError: ``directory`` exists and is not empty (a custodian's keys are never
            overwritten: every member's ciphertexts depend on them).
        CryptoError: SEAL refused the parameters.
    """
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(
            f"{directory} already exists and is not empty; refusing to overwrite a custodian"
        )
    secret, public = he.generate_keys(params)
    directory.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
    identity = SigningIdentity.generate()
    save_identity(identity, directory / IDENTITY_KEY)
    save_public_key(directory / IDENTITY_PUB, identity.public_bytes)
    atomic_write(directory / SECRET_CONTEXT, secret, mode=0o600)
    atomic_write(directory / PUBLIC_CONTEXT, public, mode=0o644)
    manifest = CustodianManifest(
        federation_id=federation_id,
        poly_modulus_degree=params.poly_modulus_degree,
        coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        scale_bits=params.scale_bits,
        context_sha256=hashlib.sha256(public).hexdigest(),
        public_key=identity.public_bytes.hex(),
        created=time.time(),
    )
    atomic_write(directory / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    return manifest


def open_custodian(directory: Path) -> CustodianDir:
    """Read a directory written by :func:`create_custodian`, checking it is whole.

    Raises:
        ConfigError: a file is missing or the manifest is malformed.
        KeyFileError: a secret file is readable by group or others, or malformed.
        IntegrityError: the public context or key is not the one the manifest names.
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    try:
        manifest = msgspec.json.decode(manifest_path.read_bytes(), type=CustodianManifest)
    except FileNotFoundError:
        raise ConfigError(
            f"{manifest_path} does not exist; run fedsec custodian init --dir {directory}"
        ) from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{manifest_path} is malformed: {exc}") from None
    identity = load_identity(directory / IDENTITY_KEY)
    if identity.public_bytes != load_public_key(directory / IDENTITY_PUB) or (
        identity.public_bytes.hex() != manifest.public_key
    ):
        raise IntegrityError(f"{directory}: identity.key, identity.pub and {MANIFEST} disagree")
    public = _read(directory / PUBLIC_CONTEXT)
    if hashlib.sha256(public).hexdigest() != manifest.context_sha256:
        raise IntegrityError(f"{directory / PUBLIC_CONTEXT} is not the context {MANIFEST} names")
    secret = _read_secret(directory / SECRET_CONTEXT)
    return CustodianDir(directory, manifest, identity, public, secret)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist (the custodian directory is incomplete)"
        ) from None


def _read_secret(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist (the custodian directory is incomplete)"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"{path} holds the federation's secret key and is accessible by group or others "
            f"(mode {stat.S_IMODE(mode):o}); treat it as leaked, or run: chmod 600 {path}"
        )
    return path.read_bytes()


# -- the decision log ------------------------------------------------------------------------


class Decision(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One line of ``decryptions.jsonl``."""

    prev: str  # SHA-256 of the line before (64 zeros for the first)
    time: float
    outcome: str  # "released" or "refused"
    round: int
    attempt: int
    reason: str  # the refusal's machine reason; "" when released
    detail: str
    contributors: list[str]
    sum_sha256: str  # the offer's digest
    log_index: int
    plaintext_sha256: str = ""


class DecisionLog:
    """The custodian's append-only record of every decision (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def read(self) -> list[Decision]:
        """Every decision, the chain checked.

        Raises:
            IntegrityError: a line is malformed or does not chain to the one before.
        """
        if not self.path.exists():
            return []
        decisions, prev = [], _FIRST_PREV
        for lineno, raw in enumerate(self.path.read_bytes().splitlines(), start=1):
            try:
                decision = msgspec.json.decode(raw, type=Decision)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise IntegrityError(f"{self.path} line {lineno} is malformed: {exc}") from None
            if decision.prev != prev:
                raise IntegrityError(
                    f"{self.path} line {lineno} does not chain to the line before it "
                    "(a decision was removed or altered)"
                )
            decisions.append(decision)
            prev = hashlib.sha256(raw).hexdigest()
        return decisions

    def released(self) -> list[Released]:
        """The sums released so far."""
        return [
            Released(d.round, d.attempt, d.sum_sha256, tuple(d.contributors))
            for d in self.read()
            if d.outcome == "released"
        ]

    def refused(self) -> set[tuple[int, int]]:
        """The attempts refused so far (a refusal stands: the attempt is not decided again)."""
        return {(d.round, d.attempt) for d in self.read() if d.outcome == "refused"}

    def decryption_refusals(self) -> int:
        """How many refusals a decryption decided (``not_integral``, ``out_of_range``,
        ``repeated_contribution``): answers about plaintexts, which the service bounds."""
        return sum(
            1 for d in self.read() if d.outcome == "refused" and d.reason in DECRYPTION_REASONS
        )

    def record_release(self, offer: HeSumOffer, release: Release) -> Decision:
        """Append a release (before the plaintext leaves the custodian)."""
        return self._append(
            offer,
            outcome="released",
            reason="",
            detail="the offered sum is the logged sum; decrypted",
            plaintext_sha256=release.statement.plaintext_sha256,
        )

    def record_refusal(self, offer: HeSumOffer, refusal: Refused) -> Decision:
        """Append a refusal and its reason."""
        return self._append(offer, outcome="refused", reason=refusal.reason, detail=refusal.detail)

    def _append(self, offer: HeSumOffer, **fields: Any) -> Decision:
        lines = self.path.read_bytes().splitlines() if self.path.exists() else []
        prev = hashlib.sha256(lines[-1]).hexdigest() if lines else _FIRST_PREV
        decision = Decision(
            prev=prev,
            time=time.time(),
            round=offer.round,
            attempt=offer.attempt,
            contributors=list(offer.contributors),
            sum_sha256=offer.sum_sha256,
            log_index=offer.log_index,
            **fields,
        )
        line = json.dumps(msgspec.to_builtins(decision), sort_keys=True).encode() + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if not lines:
            fsync_dir(self.path.parent)
        return decision
