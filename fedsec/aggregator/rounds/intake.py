"""Intake: accepting members' stage messages into the attempt in progress.

Each message is checked against the attempt (round, stage, cohort), decoded once into
the summation session's message, taken in by the session, then stored, archived and
logged in one transaction before the method returns.  A retried message identical to
the one already accepted gets the same answer (idempotent), even after a restart moved
the round on; a different one is refused as a duplicate.  A masked input also gets a
signed receipt; refused masked inputs are logged within bounds
(:mod:`fedsec.aggregator.rounds.refusals`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec

from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.aggregator.rounds.events import ContributionAccepted, ContributionRefused
from fedsec.aggregator.rounds.lifecycle import Lifecycle
from fedsec.aggregator.rounds.refusals import RefusalLog
from fedsec.aggregator.rounds.reports import PrivacyReports
from fedsec.aggregator.storage.audit_trail import store_accepted
from fedsec.aggregator.storage.leadership import NotLeader
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import (
    DuplicateMessage,
    FedsecError,
    GroupServedElsewhere,
    NotFound,
    UnknownMember,
    WrongStage,
)
from fedsec.protocol import codec, wire
from fedsec.protocol.log_entries import AcceptedEntry
from fedsec.protocol.stages import Stage
from fedsec.summation.he import HeSession, ciphertext_commitment
from fedsec.summation.session import StageMessage, decode_decryption


class Intake:
    """Takes members' messages for the attempt that :class:`Lifecycle` has in progress.

    Args:
        ctx: the round engine's shared context.
        lifecycle: owns the attempt; closes a stage once complete.
        refusals: the bounded log of refused masked inputs.
        reports: privacy reports (carried by share messages).
    """

    def __init__(
        self,
        ctx: RoundContext,
        lifecycle: Lifecycle,
        refusals: RefusalLog,
        reports: PrivacyReports,
    ) -> None:
        self._ctx = ctx
        self._lifecycle = lifecycle
        self._refusals = refusals
        self._reports = reports

    @property
    def _live(self) -> Attempt:
        return self._lifecycle.live

    # -- SecAgg+ control messages --------------------------------------------------------------

    def advertise(self, member: str, r: int, a: int, body: wire.AdvertiseKeysBody) -> None:
        self._accept(member, r, a, "advertise", wire.encode(body), body, codec.advertise_message)

    def share_keys(self, member: str, r: int, a: int, body: wire.ShareKeysBody) -> None:
        """Accept a member's shares and, when they carry one, its privacy report.

        The report is checked first and stored only once the shares are accepted, so a
        refusal of either changes nothing.  The shares are stored without the report.
        """
        raw = wire.encode(wire.ShareKeysBody(shares=body.shares))
        report = body.report
        checked = None
        try:
            if report is not None:
                checked = self._reports.check(self._live, member, r, a, report)
        except WrongStage:
            # the attempt is over: _accept answers an identical retry (its report came
            # with the first try) and refuses anything else with the same error
            pass
        except DuplicateMessage:
            # a different report came first (separately): it stands, as it would for a
            # second POST /report; the shares are not refused for it
            log.warning(
                "event=report_kept round=%d attempt=%d member=%s reason=differs_from_stored",
                r,
                a,
                member,
            )
        self._accept(member, r, a, "share_keys", raw, body, codec.share_keys_message)
        if report is not None and checked is not None:
            self._reports.store(report, checked)

    def consistency(self, member: str, r: int, a: int, body: wire.ConsistencyBody) -> None:
        self._accept(
            member, r, a, "consistency", wire.encode(body), body, codec.consistency_message
        )

    def commit(self, member: str, r: int, a: int, body: wire.CommitBody) -> None:
        """Take a member's signed commitment to its ciphertext's hash (homomorphic
        summation), logged with the hash and signature so anyone can check it."""
        spec = self._live.spec

        def decode(member: str, body: wire.CommitBody) -> StageMessage:
            if spec is None:  # pragma: no cover - expect() refused a spec-less attempt
                raise WrongStage(f"round {r} has no spec yet")
            return ciphertext_commitment(spec, member, body)

        self._accept(
            member,
            r,
            a,
            "commit",
            wire.encode(body),
            body,
            decode,
            commitment=body.vector_sha256,
            signature=body.signature,
        )

    def unmask(self, member: str, r: int, a: int, body: wire.UnmaskResponseBody) -> bool:
        """Take a survivor's unmask answer; False when it came after the attempt closed
        without needing it (the other answers already decided the sum, see
        ``ServerSession.ready_to_finalize``): nothing is stored or logged then."""
        if self._closed_without(member, r, a):
            log.info("event=unmask_not_needed round=%d attempt=%d member=%s", r, a, member)
            return False
        self._accept(member, r, a, "unmask", wire.encode(body), body, codec.unmask_message)
        return True

    def _accept(
        self,
        member: str,
        r: int,
        a: int,
        stage: Stage,
        raw: bytes,
        body: Any,
        decode: Callable[[str, Any], StageMessage],
        commitment: str | None = None,
        signature: str | None = None,
    ) -> None:
        """Accept one control message (``raw``: its canonical JSON, as stored): an
        identical retry gets the same answer; anything else is decoded once from
        ``body``, validated by the session, stored, archived and logged (with
        ``commitment`` and ``signature``, a commit's, in the entry); the stage closes
        once complete."""
        stored = self._stored(member, r, a, stage)
        if stored == raw:
            return
        live = self._live
        live.expect(member, r, a, stage)
        live.in_cohort(member)
        _refuse_different(stored, stage, member)
        live.summing().receive(stage, decode(member, body))
        self._record(live, stage, member, raw, commitment=commitment, signature=signature)
        self._lifecycle.close_if_complete()

    # -- masked input --------------------------------------------------------------------------

    def masked_input(
        self, member: str, r: int, a: int, raw: bytes, commitment: str, signature: str
    ) -> wire.Receipt:
        """Accept a masked (or, without secure summation, plain quantized) input; see
        :meth:`fedsec.aggregator.coordinator.Coordinator.masked_input`."""
        try:
            return self._masked_input(member, r, a, raw, commitment, signature)
        except (NotLeader, GroupServedElsewhere):
            # not the member's doing: this replica may not write (deposed), or the
            # member's group server still answers (fedsec.summation.served_group)
            raise
        except FedsecError as exc:
            in_cohort = self._refusals.refused(member, r, a, raw, exc)
            now = self._ctx.clock()
            self._ctx.emit(ContributionRefused(r, a, member, exc.code, now, in_cohort))
            raise

    def _masked_input(
        self, member: str, r: int, a: int, raw: bytes, commitment: str, signature: str
    ) -> wire.Receipt:
        stored = self._stored(member, r, a, "masked_input")
        if stored == raw:
            return self.receipt(member, r)
        live = self._live
        live.expect(member, r, a, "masked_input")
        live.in_cohort(member)
        _refuse_different(stored, "masked_input", member)
        digest = hashlib.sha256(raw).hexdigest()
        session = live.summing()
        statement = wire.ContributionStatement(
            federation_id=self._ctx.ws.federation_id,
            round=r,
            attempt=a,
            member=member,
            vector_sha256=digest,
            commitment=commitment,
            signature=signature,
            # he: the member binds the commitment set it was shown; a member shown
            # another set signed another digest, and its statement does not verify
            commitments_sha256=session.commitments_sha256,
        )
        entry = self._ctx.ws.roster.get(member)
        assert entry is not None
        statement.verify(entry.public_key_bytes)
        session.receive("masked_input", MaskedInput(member, raw))
        receipt = self._record(
            live,
            "masked_input",
            member,
            raw,
            receipt_for=digest,
            commitment=commitment,
            signature=signature,
        )
        assert receipt is not None
        self._ctx.emit(ContributionAccepted(r, a, member, len(raw)))
        self._lifecycle.close_if_complete()
        return receipt

    # -- homomorphic summation: the custodian's decryption ---------------------------------------

    def he_session(self, member: str, r: int, a: int, stage: str) -> HeSession:
        """The homomorphic session of attempt (r, a), for its custodian ``member``.

        Raises:
            WrongStage: not that attempt, or it has not reached ``stage`` (or is over).
            UnknownMember: not a homomorphic attempt, or ``member`` is not its custodian.
        """
        live = self._live
        live.expect_at_least(member, r, a, stage)
        session = live.summing()
        if not isinstance(session, HeSession) or member != session.spec.custodian:
            raise UnknownMember(f"{member} is not the key custodian of round {r}")
        return session

    def decryption(self, member: str, r: int, a: int, raw: bytes) -> None:
        """Accept the custodian's decryption of attempt (r, a)'s ciphertext sum (``raw``:
        the framed statement and plaintext, stored as received): stored as a decrypt
        message, the plaintext archived, the statement logged as an ``he_decryption``
        entry, in one transaction; then the stage closes (finalize, the new model).

        Raises:
            WrongStage, UnknownMember: see :meth:`he_session` (the stage is decrypt).
            DuplicateMessage: another decryption was accepted before.
            PayloadError, SignatureError, ProtocolError, IntegrityError, BadVector: the
                decryption does not check out (:class:`HeSession`); nothing stored.
        """
        stored = self._stored(member, r, a, "decrypt")
        if stored == raw:
            return
        # decoded first: a malformed body is refused as such, whatever the stage
        message = decode_decryption(member, raw, self._ctx.cfg.server.max_json_bytes)
        live = self._live
        live.expect(member, r, a, "decrypt")
        session = self.he_session(member, r, a, "decrypt")
        _refuse_different(stored, "decrypt", member)
        session.receive("decrypt", message)
        ctx = self._ctx
        try:
            ctx.trail.keep(message.plaintext)
            with ctx.ws.state.transaction():
                ctx.ws.state.messages.add(r, a, "decrypt", member, raw)
                ctx.trail.append(message.statement)
        except BaseException:
            session.decryption = None  # not stored: the session must not hold it either
            raise
        log.info("event=he_decryption_accepted round=%d attempt=%d custodian=%s", r, a, member)
        self._lifecycle.close_if_complete()

    # -- storage -------------------------------------------------------------------------------

    def _record(
        self,
        live: Attempt,
        stage: Stage,
        member: str,
        raw: bytes,
        receipt_for: str | None = None,
        commitment: str | None = None,
        signature: str | None = None,
    ) -> wire.Receipt | None:
        """Store an accepted message, archive it and log it, in one transaction; with
        ``receipt_for`` (the contribution's sha256), also sign and store its receipt.
        ``commitment`` and ``signature``: a masked input's contribution statement."""
        ctx = self._ctx
        accepted = AcceptedEntry(
            round=live.round,
            attempt=live.attempt,
            stage=stage,
            member=member,
            sha256=ctx.trail.keep_message(raw),
            bytes=len(raw),
            commitment=commitment,
            signature=signature,
        )
        with ctx.ws.state.transaction():
            receipt = store_accepted(
                ctx.ws.state,
                ctx.trail.append,
                ctx.ws.signer,
                ctx.ws.federation_id,
                ctx.clock,
                accepted,
                raw,
                receipt_for,
            )
        if ctx.faults.crash_at:  # chaos tests only: off the hot path otherwise
            count = ctx.ws.state.messages.count(live.round, live.attempt, stage)
            ctx.faults.crash(live.round, f"{stage}:{count}")
        return receipt

    def _stored(self, member: str, r: int, a: int, stage: str) -> bytes | None:
        """The message ``member`` had durably accepted for that attempt's ``stage``, if
        any.  One identical to it is the member's retry and gets the same answer whatever
        the stage is now, e.g. after an answer lost to a crash (the message that moved
        the round on, say the last advertise, was stored, then the aggregator died before
        answering), not wrong_stage; a different one is refused (:func:`_refuse_different`)
        once the attempt is known to be the current one.  Read once: nothing is written
        between the read and the refusal."""
        return self._ctx.ws.state.messages.get(r, a, stage, member)

    def _closed_without(self, member: str, r: int, a: int) -> bool:
        """True for the late unmask answer of a member whose masked input the attempt,
        now closed, summed without waiting for that answer."""
        if self._live.is_current(r, a):
            return False
        state = self._ctx.ws.state
        row = state.rounds.get(r, a)
        return (
            row is not None
            and row.stage == "closed"
            and state.messages.get(r, a, "masked_input", member) is not None
            and state.messages.get(r, a, "unmask", member) is None
        )

    def receipt(self, member: str, round_: int) -> wire.Receipt:
        """Raises NotFound: no accepted contribution from ``member`` in that round."""
        stored = self._ctx.ws.state.receipts.latest(round_, member)
        if stored is None:
            raise NotFound(f"no accepted contribution from {member} in round {round_}")
        return msgspec.json.decode(stored, type=wire.Receipt)


def _refuse_different(stored: bytes | None, stage: str, member: str) -> None:
    """Raises DuplicateMessage: ``member`` had another ``stage`` message accepted in the
    current attempt (``stored``, already known to differ from the one now sent)."""
    if stored is not None:
        raise DuplicateMessage(f"{member} already sent a different {stage} message this round")
