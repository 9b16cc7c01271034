"""Hidden model versions (``he.model_visible_to_aggregator = false``): the key
custodian's sealed releases, opened with this member's identity key once the custodian's
signature checks out under the key the pinned, admin-signed roster gives it.  The
aggregator that serves the file cannot read it, nor pass off another as the custodian's.
"""

from __future__ import annotations

from fedsec.agent.pinned_roster import PinnedRoster
from fedsec.aggregator_client import AggregatorClient
from fedsec.crypto.identity import SigningIdentity
from fedsec.errors import IntegrityError
from fedsec.protocol import he_release
from fedsec.protocol.wire import RoundSpec


class HiddenModels:
    """Opens hidden model versions (``he.model_visible_to_aggregator = false``) with this
    member's identity key, checking the custodian's signature from the pinned roster."""

    def __init__(self, roster: PinnedRoster, member: str, identity: SigningIdentity) -> None:
        self._roster = roster
        self._member = member
        self._identity = identity

    async def open(self, client: AggregatorClient, spec: RoundSpec, data: bytes) -> bytes:
        """The model file inside ``data``, a sealed version's file.

        Raises:
            IntegrityError: the roster names no such custodian, the model is not sealed to
                this member, or something inside is not the statement's.
            SignatureError, DecryptionError, PayloadError: see
                :func:`~fedsec.protocol.he_release.open_release`.
        """
        custodians = await self._roster.keys(client, spec.federation_id, role="custodian")
        key = custodians.get(spec.custodian)
        if key is None:
            raise IntegrityError(
                f"the roster names no active custodian {spec.custodian!r}, whom the spec names"
            )
        opened = he_release.open_release(
            data, key, self._member, self._identity.x25519_secret(), spec.dim + 1
        )
        return opened.model
