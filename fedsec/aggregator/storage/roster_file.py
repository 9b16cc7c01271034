"""The roster store: the admin-signed entries of one federation, kept on disk.

The entries themselves, their signature and their log events are the shared kernel's
(:mod:`fedsec.protocol.roster`); this module keeps them in ``root/roster.json`` and
lets only entries signed by the federation admin in.  :meth:`Roster.add` and
:meth:`Roster.revoke` return each change as a transparency-log event.

Ids and keys are never reused, even after revocation, so an old signed entry can
never be mistaken for a new enrolment.

The file is written atomically (temp file, fsync, rename).  Writers (the CLI)
serialise on a lock file and re-read before changing it; a running aggregator picks
up their changes with :meth:`Roster.reload_if_changed`.  A monotonic ``serial``
numbers every change; a reload never goes back to a lower one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedsec.crypto.identity import PublicIdentity, SigningIdentity, key_id
from fedsec.errors import ConfigError, FedsecError, IntegrityError, NotFound, SignatureError
from fedsec.fsio import atomic_write
from fedsec.protocol.roster import (
    MAX_ROSTER_BYTES,
    ROSTER_FORMAT,
    RosterEntry,
    read_roster_document,
    revoke_roster_entry,
    roster_event,
    verify_roster_entry,
)

log = logging.getLogger(__name__)

ROSTER_FILE = "roster.json"


class Roster:
    """The members of one federation, as stored in ``root/roster.json``."""

    def __init__(self, root: Path, federation_id: str, admin_public: bytes) -> None:
        """Load and verify the roster (an absent file is an empty roster).

        Raises:
            IntegrityError / SignatureError: the file is malformed, belongs to another
                federation or admin, or holds an entry that does not verify.
        """
        self.root = Path(root)
        self.path = self.root / ROSTER_FILE
        self._lock_path = self.root / f".{ROSTER_FILE}.lock"
        self.federation_id = federation_id
        self.admin_public = PublicIdentity(admin_public).public_bytes
        self.last_reload_error: str | None = None
        self._mutex = threading.RLock()
        self._serial = 0
        self._entries: dict[str, RosterEntry] = {}
        self._by_key: dict[str, RosterEntry] = {}
        # kept with the entries: the cohort asks after every join (O(n) each was O(n^2))
        self._active_agents: tuple[RosterEntry, ...] = ()
        self._stat: tuple[int, int, int] | None = None
        self._failed_stat: tuple[int, int, int] | None = None
        serial, entries, stat = self._read_disk()
        self._install(serial, entries, stat)

    # -- queries ----------------------------------------------------------------------

    @property
    def serial(self) -> int:
        """Number of changes ever made to this roster."""
        return self._serial

    def entries(self) -> list[RosterEntry]:
        """All entries, active and revoked, in the order they were added."""
        with self._mutex:
            return list(self._entries.values())

    def get(self, agent_id: str) -> RosterEntry | None:
        """The entry for ``agent_id`` (active or revoked), or None."""
        with self._mutex:
            return self._entries.get(agent_id)

    def by_key_id(self, key_id: str) -> RosterEntry | None:
        """The entry whose public key has this key id (active or revoked), or None."""
        with self._mutex:
            return self._by_key.get(key_id)

    def active_agents(self) -> list[RosterEntry]:
        """Active entries with role "agent": the members that may contribute updates."""
        with self._mutex:
            return list(self._active_agents)

    def active_agent_count(self) -> int:
        """How many :meth:`active_agents` there are, without listing them."""
        with self._mutex:
            return len(self._active_agents)

    def verify_all(self, admin_public: bytes | None = None) -> None:
        """Re-check every entry's signature (against ``admin_public`` if given).

        Raises:
            IntegrityError / SignatureError: naming the first bad entry.
        """
        key = self.admin_public if admin_public is None else admin_public
        with self._mutex:
            for entry in self._entries.values():
                verify_roster_entry(entry, key, self.federation_id)

    # -- changes ----------------------------------------------------------------------

    def add(self, entry: RosterEntry) -> dict[str, Any]:
        """Enrol a new member.

        Returns:
            The ``roster_add`` event for the transparency log.

        Raises:
            SignatureError: the entry is not signed by this roster's admin.
            IntegrityError: the entry is invalid or not active.
            ConfigError: the id or the public key is already in the roster (even revoked).
        """
        verify_roster_entry(entry, self.admin_public, self.federation_id)
        if entry.status != "active":
            raise IntegrityError(f"roster entry {entry.agent_id!r}: a new entry must be active")
        with self._exclusive():
            if entry.agent_id in self._entries:
                raise ConfigError(
                    f"roster already has an entry with id {entry.agent_id!r} "
                    f"({self._entries[entry.agent_id].status}); ids are never reused"
                )
            other = self._by_key.get(entry.key_id)
            if other is not None:
                raise ConfigError(
                    f"public key {entry.key_id} is already enrolled as {other.agent_id!r} "
                    f"({other.status}); keys are never reused"
                )
            entries = [*self._entries.values(), entry]
            self._write(self._serial + 1, entries)
            log.info("roster_add agent=%s key=%s role=%s", entry.agent_id, entry.key_id, entry.role)
            return roster_event("roster_add", self._serial, self.federation_id, entry)

    def revoke(
        self, agent_id: str, admin: SigningIdentity, *, at: float | None = None
    ) -> dict[str, Any]:
        """Revoke a member with an admin-signed revocation.

        Returns:
            The ``roster_revoke`` event for the transparency log.

        Raises:
            SignatureError: ``admin`` is not this roster's admin key.
            NotFound: no such member.
            ConfigError: it is already revoked.
        """
        if admin.public_bytes != self.admin_public:
            raise SignatureError(
                f"key {admin.key_id} is not the admin key of federation {self.federation_id!r}"
            )
        with self._exclusive():
            current = self._entries.get(agent_id)
            if current is None:
                raise NotFound(f"roster has no entry with id {agent_id!r}")
            if current.status == "revoked":
                raise ConfigError(f"roster entry {agent_id!r} is already revoked")
            revoked = revoke_roster_entry(current, admin, self.federation_id, at=at)
            entries = [revoked if e.agent_id == agent_id else e for e in self._entries.values()]
            self._write(self._serial + 1, entries)
            log.info("roster_revoke agent=%s key=%s", agent_id, revoked.key_id)
            return roster_event("roster_revoke", self._serial, self.federation_id, revoked)

    def reload_if_changed(self) -> bool:
        """Pick up changes another process made to roster.json.

        A file that does not verify, or whose serial goes backwards, is refused: the
        roster already loaded stays in force, the reason is logged once and kept in
        :attr:`last_reload_error`.

        Returns:
            True if a newer roster was loaded.
        """
        with self._mutex:
            stat = self._stat_key()
            if stat == self._stat or (stat is not None and stat == self._failed_stat):
                return False
            try:
                serial, entries, stat = self._read_disk()
                if serial < self._serial:
                    raise IntegrityError(
                        f"{self.path}: serial {serial} is older than the loaded {self._serial}"
                    )
                if serial == self._serial and entries != list(self._entries.values()):
                    raise IntegrityError(
                        f"{self.path}: content changed without a new serial ({serial})"
                    )
            except FedsecError as exc:
                self._failed_stat = stat
                self.last_reload_error = exc.detail
                log.warning("roster_reload_refused reason=%r", exc.detail)
                return False
            changed = serial != self._serial
            self._install(serial, entries, stat)
            self.last_reload_error = None
            if changed:
                log.info("roster_reloaded serial=%d entries=%d", serial, len(entries))
            return changed

    # -- internals --------------------------------------------------------------------

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the cross-process lock and bring the in-memory roster up to date."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._mutex, open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                serial, entries, stat = self._read_disk()
                if serial < self._serial:
                    raise IntegrityError(
                        f"{self.path}: serial {serial} is older than the loaded {self._serial}"
                    )
                self._install(serial, entries, stat)
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read_disk(self) -> tuple[int, list[RosterEntry], tuple[int, int, int] | None]:
        stat = self._stat_key()
        if stat is None:
            return 0, [], None
        if stat[1] > MAX_ROSTER_BYTES:
            raise IntegrityError(f"{self.path} is {stat[1]} bytes, the limit is {MAX_ROSTER_BYTES}")
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return 0, [], None
        doc = read_roster_document(raw, self.admin_public, self.federation_id, str(self.path))
        return doc.serial, doc.entries, stat

    def _install(
        self, serial: int, entries: list[RosterEntry], stat: tuple[int, int, int] | None
    ) -> None:
        self._serial = serial
        self._entries = {e.agent_id: e for e in entries}
        self._by_key = {e.key_id: e for e in entries}
        self._active_agents = tuple(e for e in entries if e.is_active and e.role == "agent")
        self._stat = stat
        self._failed_stat = None

    def _write(self, serial: int, entries: list[RosterEntry]) -> None:
        doc = {
            "format": ROSTER_FORMAT,
            "federation_id": self.federation_id,
            "admin_key_id": key_id(self.admin_public),
            "serial": serial,
            "entries": [e.to_dict() for e in entries],
        }
        body = json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write(self.path, body)
        self._install(serial, entries, self._stat_key())
