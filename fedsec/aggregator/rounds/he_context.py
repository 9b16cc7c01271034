"""The federation's public CKKS context (``secure_sum = "he"``): published once by the
key custodian, checked, kept in the workspace (``he/context.json``), archived and logged,
and served to every member that encrypts under it.

The aggregator never holds the secret key: a context that carries one is refused.  The
custodian's signed statement names the context by its SHA-256, and every signed round
spec names the same hash, so a member (and the auditor) can tell the context it was
served is the one the custodian published.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import TYPE_CHECKING

import msgspec

from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.errors import (
    DuplicateMessage,
    ForbiddenError,
    IntegrityError,
    NotFound,
    PayloadError,
    ProtocolError,
)
from fedsec.fsio import atomic_write
from fedsec.protocol import wire
from fedsec.protocol.log import entry_from_line
from fedsec.summation import mode_named

if TYPE_CHECKING:  # TenSEAL is the ``he`` extra's: only an he federation loads it
    from fedsec.crypto.he import HeParams, PublicContext


class HeContextDesk:
    """The published context of a homomorphic-summation federation.

    Args:
        ctx: the round engine's shared context.
    """

    def __init__(self, ctx: RoundContext) -> None:
        self._ctx = ctx
        self._stored: wire.HeContext | None = None
        self._public: PublicContext | None = None
        self._enabled = mode_named(ctx.cfg.round.secure_sum).custodian_decrypts
        if self._enabled:
            self._load()

    @property
    def custodian(self) -> str:
        return self._ctx.cfg.he.custodian if self._enabled else ""

    @property
    def sha256(self) -> str:
        """The published context's SHA-256, or "" before it is published."""
        return self._stored.statement.context_sha256 if self._stored is not None else ""

    @property
    def public_context(self) -> PublicContext | None:
        return self._public

    def params(self) -> HeParams:
        """The federation's CKKS parameters (``[he]``)."""
        from fedsec.crypto.he import HeParams

        he = self._ctx.cfg.he
        return HeParams(he.poly_modulus_degree, tuple(he.coeff_mod_bit_sizes), he.scale_bits)

    def served(self) -> wire.HeContext:
        """Raises NotFound: not a homomorphic federation, or nothing published yet."""
        if not self._enabled:
            raise NotFound("this federation does not use homomorphic summation")
        if self._stored is None:
            raise NotFound("the key custodian has not published the public CKKS context yet")
        return self._stored

    # -- publication ------------------------------------------------------------------------------

    def publish(self, member: str, published: wire.HeContext) -> bool:
        """Take the custodian's context; False for a repeat of the one already stored.

        Raises:
            ProtocolError: not a homomorphic federation.
            ForbiddenError: ``member`` is not ``he.custodian``.
            SignatureError: the statement is not signed by the custodian's roster key.
            IntegrityError: the statement names another federation or custodian, or
                another hash than the context's.
            PayloadError: other parameters than ``[he]``; a context that is not base64
                or over the size bound.
            CryptoError: the context does not load as a public one (a secret key in it,
                no public key, other parameters or scale).
            DuplicateMessage: another context was published before (409).
        """
        if not self._enabled:
            raise ProtocolError("this federation does not use homomorphic summation")
        custodian = self.custodian
        if member != custodian:
            raise ForbiddenError(f"{member} is not the federation's key custodian ({custodian})")
        if self._stored is not None:
            if published == self._stored:
                return False
            raise DuplicateMessage(
                "the federation already has its public CKKS context "
                f"{self._stored.statement.context_sha256[:16]}…; it is published once"
            )
        data, public = self._check(member, published)
        self._store(published, data)
        self._stored, self._public = published, public
        log.info(
            "event=he_context_published custodian=%s sha256=%s",
            member,
            published.statement.context_sha256[:16],
        )
        self._ctx.changed()
        return True

    def _check(self, member: str, published: wire.HeContext) -> tuple[bytes, PublicContext]:
        from fedsec.crypto.he import load_public_context

        st, ws = published.statement, self._ctx.ws
        entry = ws.roster.get(member)
        if entry is None or not entry.is_active or entry.role != "custodian":
            raise ForbiddenError(f"{member} is not an active key custodian on the roster")
        st.verify(entry.public_key_bytes)
        if (st.federation_id, st.custodian) != (ws.federation_id, member):
            raise IntegrityError(
                f"the context statement is for {st.federation_id}/{st.custodian}, not "
                f"{ws.federation_id}/{member}"
            )
        params = self.params()
        theirs = (st.poly_modulus_degree, tuple(st.coeff_mod_bit_sizes), st.scale_bits)
        ours = (params.poly_modulus_degree, params.coeff_mod_bit_sizes, params.scale_bits)
        if theirs != ours:
            raise PayloadError(
                f"the context's parameters N = {theirs[0]}, moduli {list(theirs[1])}, scale "
                f"2^{theirs[2]} are not the federation's N = {ours[0]}, moduli "
                f"{list(ours[1])}, scale 2^{ours[2]} ([he])"
            )
        limit = params.context_max_bytes(secret=False)
        if len(published.context) > 4 * (limit // 3 + 1):  # bounded before decoding
            raise PayloadError(f"the context is over the {limit} bytes a public one can take")
        try:
            data = base64.b64decode(published.context, validate=True)
        except (binascii.Error, ValueError):
            raise PayloadError("the context is not base64") from None
        if hashlib.sha256(data).hexdigest() != st.context_sha256:
            raise IntegrityError("the context does not hash to the statement's context_sha256")
        return data, load_public_context(data, params, limit)

    def _store(self, published: wire.HeContext, data: bytes) -> None:
        """Archive the bytes, then log the statement and write the file in one
        transaction (a failed write rolls the entry back; a crash after the write and
        before the commit is repaired at start-up by :meth:`_load`)."""
        ctx = self._ctx
        ctx.trail.keep(data)
        with ctx.ws.state.transaction():
            ctx.trail.append(published.statement)
            atomic_write(ctx.ws.he_context_path, wire.encode(published), parents_mode=0o755)

    def _load(self) -> None:
        """The stored context, loaded once; its statement logged if a crash lost that."""
        from fedsec.crypto.he import load_public_context

        path = self._ctx.ws.he_context_path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        stored = msgspec.json.decode(raw, type=wire.HeContext)
        data = base64.b64decode(stored.context, validate=True)
        params = self.params()
        self._public = load_public_context(data, params, params.context_max_bytes(secret=False))
        self._stored = stored
        if not self._logged(stored.statement):
            log.warning("event=he_context_relogged sha256=%s", stored.statement.context_sha256)
            self._ctx.trail.keep(data)
            self._ctx.trail.append(stored.statement)

    def _logged(self, statement: wire.HeContextStatement) -> bool:
        for _, line in self._ctx.ws.state.log.log_lines():
            if entry_from_line(line).decode() == statement:
                return True
        return False
