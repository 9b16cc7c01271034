"""The admin-signed roster as this agent trusts it: the admin key pinned on first use.

The aggregator serves the roster, so without the pin it could sign a roster of its own
and substitute keys (SecAgg+ verifies every relayed key against it; audit reveals are
sealed to the auditor keys it names).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from fedsec.aggregator_client import AggregatorClient
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import SignatureError
from fedsec.keys import load_public_key, save_public_key
from fedsec.protocol.roster import verify_roster_entry
from fedsec.protocol.wire import unhex

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")

#: The roster admin key, pinned on first use (see :class:`PinnedRoster`).
ADMIN_KEY_FILE: Final = "roster_admin.pub"
#: Roster entries whose admin signature verified, as (admin key, federation, signed
#: bytes, signature): a signature that verified over these exact bytes verifies again,
#: so every agent in the process shares the set.  One agent verifies each entry once; a
#: simulation of 1,000 agents in one process verified 1,000 x 1,000 (a minute of CPU).
#: Bounded: past this many it is emptied and entries are verified again.
MAX_VERIFIED_ENTRIES: Final = 100_000
_VERIFIED: set[tuple[bytes, str, bytes, str]] = set()


class PinnedRoster:
    """Fetches and verifies the roster for ``member``, whose key is ``identity``'s.

    Args:
        state_dir: where the admin key is pinned (``roster_admin.pub``).
    """

    def __init__(self, state_dir: Path, member: str, identity: SigningIdentity) -> None:
        self.state_dir = state_dir
        self.member = member
        self.identity = identity
        self._cache: dict[str, tuple[int, dict[str, bytes]]] = {}

    async def keys(
        self,
        client: AggregatorClient,
        federation_id: str,
        role: str = "agent",
        serial: int = 0,
    ) -> dict[str, bytes]:
        """Active members' public keys of ``role`` from the admin-signed roster.

        The admin key is pinned on first use in ``state_dir/roster_admin.pub`` and a
        different one is refused afterwards.

        Raises:
            SignatureError: the admin key changed, an entry does not verify, or the
                roster holds a different key for this agent.
        """
        cached = self._cache.get(role)
        if serial and cached is not None and cached[0] == serial:
            return cached[1]  # unchanged since the last round (the serial says so)
        body = await client.roster()
        admin = unhex(body.admin_public_key, "roster admin public key", 32)
        self._check_pin(admin)
        roster: dict[str, bytes] = {}
        for entry in body.entries:
            # each entry is verified once per process; later rosters repeat most entries
            seen = (admin, federation_id, entry.signed_bytes(federation_id), entry.admin_signature)
            if seen not in _VERIFIED:
                verify_roster_entry(entry, admin, federation_id)
                if len(_VERIFIED) >= MAX_VERIFIED_ENTRIES:
                    _VERIFIED.clear()
                _VERIFIED.add(seen)
            if entry.is_active and entry.role == role:
                roster[entry.agent_id] = entry.public_key_bytes
        if role == "agent" and roster.get(self.member) != self.identity.public_bytes:
            raise SignatureError(
                f"the roster does not enrol {self.member!r} as an active agent with this "
                f"agent's key {self.identity.key_id}"
            )
        if serial:
            self._cache[role] = (serial, roster)
        return roster

    def _check_pin(self, admin: bytes) -> None:
        pinned_path = self.state_dir / ADMIN_KEY_FILE
        if pinned_path.exists():
            pinned = load_public_key(pinned_path)
            if pinned != admin:
                raise SignatureError(
                    f"the roster is signed by admin key {admin.hex()[:16]}..., not the key "
                    f"{pinned.hex()[:16]}... pinned in {pinned_path}; if the consortium really "
                    "rotated its admin key, replace that file with the new key"
                )
        else:
            save_public_key(pinned_path, admin)
            log.warning("roster_admin_pinned key=%s file=%s", admin.hex(), pinned_path)
