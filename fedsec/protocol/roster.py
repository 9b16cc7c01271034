"""Roster entries: who may take part in a federation, with which key and role.

Each :class:`RosterEntry` is signed by the federation admin's Ed25519 key (domain
``"roster-entry"``, over the canonical JSON of the entry's fields and the federation
id), so the aggregator cannot enrol members of its own or swap a member's key: anyone
holding the admin public key can check every entry with :func:`verify_roster_entry`.

A revocation is the same entry re-signed with ``status = "revoked"`` and the time of
revocation.  Each change travels in the transparency log as an event
(:func:`roster_event`, read back with :func:`entry_from_event`).

This is the part agent, aggregator, auditor and peers share, with no I/O: the entries and
the ``roster.json`` document that holds them (:func:`read_roster_document`); the
aggregator's on-disk store (its lock and live reload) is
:mod:`fedsec.aggregator.storage.roster_file`, and gossip peers read the same file
(``roster_file`` in ``peer.toml``).
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Literal

import msgspec

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, canonical_json, key_id
from fedsec.errors import IntegrityError, SignatureError

ROSTER_ENTRY_DOMAIN = "roster-entry"
ROSTER_FORMAT = "fedsec-roster/1"
# A roster of 100k members is ~30 MB of JSON; refusing larger files bounds what a
# corrupted or hostile file can cost to parse.
MAX_ROSTER_BYTES = 64 * 1024 * 1024

#: agent: contributes updates; observer: reads status, dashboard, metrics; auditor:
#: challenges and checks contributions; custodian: holds the homomorphic secret key and
#: decrypts only aggregates (``secure_sum = "he"``).
Role = Literal["agent", "observer", "auditor", "custodian"]
Status = Literal["active", "revoked"]

# Identifiers (members, federations, datasets) appear in URLs, file names and log lines:
# keep them to a safe alphabet.  fedsec.config checks configured ids against it too.
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_HEX = re.compile(r"^[0-9a-f]{64}$")
_SIG_HEX = re.compile(r"^[0-9a-f]{128}$")


class RosterEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One member: id, Ed25519 public key (hex), role, weight cap and status, admin-signed."""

    agent_id: str
    public_key: str
    role: Role
    max_weight: float | None
    status: Status
    added_at: float
    revoked_at: float | None = None
    admin_signature: str = ""

    @property
    def public_key_bytes(self) -> bytes:
        return bytes.fromhex(self.public_key)

    @property
    def key_id(self) -> str:
        return key_id(self.public_key_bytes)

    @property
    def is_active(self) -> bool:
        return self.status == "active"

    def signed_bytes(self, federation_id: str) -> bytes:
        """The bytes the admin signs: every field but the signature, plus the federation."""
        return canonical_json(
            {
                "federation_id": federation_id,
                "agent_id": self.agent_id,
                "public_key": self.public_key,
                "role": self.role,
                "max_weight": None if self.max_weight is None else float(self.max_weight),
                "status": self.status,
                "added_at": float(self.added_at),
                "revoked_at": None if self.revoked_at is None else float(self.revoked_at),
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (as stored in roster.json and in log events)."""
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result


def _check_entry_fields(entry: RosterEntry) -> None:
    if not ID_PATTERN.fullmatch(entry.agent_id):
        raise IntegrityError(f"roster entry id {entry.agent_id!r} is not a valid identifier")
    if not _KEY_HEX.fullmatch(entry.public_key):
        raise IntegrityError(
            f"roster entry {entry.agent_id!r}: public key must be 64 lowercase hex digits"
        )
    if entry.max_weight is not None and not 0 < entry.max_weight <= 1:
        raise IntegrityError(
            f"roster entry {entry.agent_id!r}: max_weight must be in (0, 1], got {entry.max_weight}"
        )
    if not math.isfinite(entry.added_at):
        raise IntegrityError(f"roster entry {entry.agent_id!r}: added_at is not finite")
    if (entry.status == "revoked") != (entry.revoked_at is not None):
        raise IntegrityError(
            f"roster entry {entry.agent_id!r}: revoked_at must be set exactly when revoked"
        )


def sign_roster_entry(
    *,
    federation_id: str,
    agent_id: str,
    public_key: bytes,
    role: Role,
    admin: SigningIdentity,
    max_weight: float | None = None,
    added_at: float | None = None,
) -> RosterEntry:
    """Create an active entry signed by the admin key.

    Raises:
        IntegrityError: invalid id, key length or max_weight.
    """
    if len(public_key) != 32:
        raise IntegrityError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    unsigned = RosterEntry(
        agent_id=agent_id,
        public_key=public_key.hex(),
        role=role,
        max_weight=None if max_weight is None else float(max_weight),
        status="active",
        added_at=time.time() if added_at is None else float(added_at),
    )
    _check_entry_fields(unsigned)
    return _signed(unsigned, admin, federation_id)


def revoke_roster_entry(
    entry: RosterEntry, admin: SigningIdentity, federation_id: str, *, at: float | None = None
) -> RosterEntry:
    """The admin-signed revocation of ``entry`` (same fields, status "revoked")."""
    revoked = msgspec.structs.replace(
        entry,
        status="revoked",
        revoked_at=time.time() if at is None else float(at),
        admin_signature="",
    )
    return _signed(revoked, admin, federation_id)


def _signed(entry: RosterEntry, admin: SigningIdentity, federation_id: str) -> RosterEntry:
    signature = admin.sign(ROSTER_ENTRY_DOMAIN, entry.signed_bytes(federation_id))
    return msgspec.structs.replace(entry, admin_signature=signature.hex())


def verify_roster_entry(entry: RosterEntry, admin_public: bytes, federation_id: str) -> None:
    """Check an entry's fields and admin signature.

    Raises:
        IntegrityError: a field is invalid.
        SignatureError: the admin signature is missing or does not verify.
    """
    _check_entry_fields(entry)
    if not _SIG_HEX.fullmatch(entry.admin_signature):
        raise SignatureError(f"roster entry {entry.agent_id!r} has no valid admin signature")
    try:
        PublicIdentity(admin_public).verify(
            ROSTER_ENTRY_DOMAIN,
            entry.signed_bytes(federation_id),
            bytes.fromhex(entry.admin_signature),
        )
    except SignatureError:
        raise SignatureError(
            f"roster entry {entry.agent_id!r}: admin signature does not verify"
        ) from None


def roster_event(
    kind: Literal["roster_add", "roster_revoke"],
    serial: int,
    federation_id: str,
    entry: RosterEntry,
) -> dict[str, Any]:
    """A roster change as a transparency-log event (JSON-ready dict)."""
    return {
        "type": kind,
        "federation_id": federation_id,
        "serial": serial,
        "entry": entry.to_dict(),
    }


def entry_from_event(event: dict[str, Any]) -> RosterEntry:
    """The entry carried by a roster event (its signature is not checked here).

    Raises:
        IntegrityError: the event is malformed.
    """
    try:
        return msgspec.convert(event["entry"], type=RosterEntry, strict=True)
    except (KeyError, TypeError, msgspec.ValidationError) as exc:
        raise IntegrityError(f"roster event is malformed: {exc}") from None


class RosterDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``roster.json``: every entry of one federation, and the serial of its last change."""

    format: str
    federation_id: str
    admin_key_id: str
    serial: int
    entries: list[RosterEntry]


def read_roster_document(
    raw: bytes, admin_public: bytes, federation_id: str, source: str
) -> RosterDocument:
    """The roster document in ``raw`` (read from ``source``, which errors name), once its
    size, format, federation, admin key and every entry's signature are checked and no
    two entries share an id or a key.

    Raises:
        IntegrityError: any of those does not hold.
        SignatureError: an entry's admin signature is missing or does not verify.
    """
    if len(raw) > MAX_ROSTER_BYTES:
        raise IntegrityError(f"{source} is {len(raw)} bytes, the limit is {MAX_ROSTER_BYTES}")
    try:
        doc = msgspec.json.decode(raw, type=RosterDocument)
    except msgspec.DecodeError as exc:
        raise IntegrityError(f"{source} is malformed: {exc}") from None
    if doc.format != ROSTER_FORMAT:
        raise IntegrityError(f"{source}: format {doc.format!r} is not {ROSTER_FORMAT!r}")
    if doc.federation_id != federation_id:
        raise IntegrityError(
            f"{source} belongs to federation {doc.federation_id!r}, not {federation_id!r}"
        )
    admin_id = key_id(admin_public)
    if doc.admin_key_id != admin_id:
        raise IntegrityError(
            f"{source} was written for admin key {doc.admin_key_id}, not {admin_id}"
        )
    ids: set[str] = set()
    keys: set[str] = set()
    for entry in doc.entries:
        verify_roster_entry(entry, admin_public, federation_id)
        if entry.agent_id in ids or entry.public_key in keys:
            raise IntegrityError(f"{source}: entry {entry.agent_id!r} duplicates an id or a key")
        ids.add(entry.agent_id)
        keys.add(entry.public_key)
    return doc
