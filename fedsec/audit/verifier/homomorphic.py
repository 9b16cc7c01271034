"""Homomorphic summation: the key custodian's statements and each round's sum.

Every ``he_context`` statement is signed by its custodian (roster role ``custodian``);
every ``he_decryption`` by the round's custodian, naming exactly the attempt's accepted
masked inputs, each once, at least ``min_agents`` of them, under the context the
signed spec names.  The archived ciphertexts are re-added under the archived public
context and the sum's digest compared; the archived plaintext's length and hash are
checked, and it is read as the round's ring sum.  Each member's ciphertext must be
the one it committed to before any ciphertext was logged.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.attempts import Attempt, Consulted, ModeAudit, Rederived
from fedsec.audit.verifier.retention import ArchiveRecords
from fedsec.crypto.quantize import ring_from_integers
from fedsec.errors import FedsecError
from fedsec.protocol import he_release, wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.log_entries import AcceptedEntry, AggregateEntry
from fedsec.summation.he import CiphertextReplay

if TYPE_CHECKING:
    from fedsec.audit.verifier.identity import Identities
    from fedsec.crypto.he import PublicContext

_PLAINTEXT = "plaintext of the custodian's decryption"


class HeContexts:
    """The custodians' published CKKS contexts, each public context loaded once."""

    def __init__(self, identities: Identities, records: ArchiveRecords) -> None:
        self.identities = identities
        self.records = records
        # context sha256 -> (log index, the custodian's statement)
        self.logged: dict[str, tuple[int, wire.HeContextStatement]] = {}
        self._public: dict[str, PublicContext] = {}

    def on_he_context(self, index: int, statement: wire.HeContextStatement) -> None:
        """Raises: EntryProblem: not signed by an active custodian of this federation."""
        self.identities.verify_custodian(statement, "the CKKS context statement")
        self.logged[statement.context_sha256] = (index, statement)

    def public(self, index: int, round_: int, context_sha256: str) -> PublicContext:
        """The archived public context ``context_sha256`` (logged), loaded.

        Raises:
            EntryProblem: missing from the archive, or it does not load.
        """
        public = self._public.get(context_sha256)
        if public is not None:
            return public
        he = _he()
        context_index, context = self.logged[context_sha256]
        params = params_of(context)
        what = f"public CKKS context of log entry {context_index}"
        data = self.records.get(index, round_, what, context_sha256)
        try:
            loaded: PublicContext = he.load_public_context(
                data, params, params.context_max_bytes(False)
            )
        except FedsecError as exc:
            raise EntryProblem(f"the archived {what} does not load: {exc.detail}") from None
        self._public[context_sha256] = loaded
        return loaded


def _he() -> Any:
    try:
        from fedsec.crypto import he
    except ModuleNotFoundError:
        raise EntryProblem(
            "re-adding a homomorphic round's ciphertexts needs TenSEAL: install fedsec "
            "with the he extra"
        ) from None
    return he


def params_of(context: wire.HeContextStatement) -> Any:
    """The CKKS parameters a context statement publishes (``he.HeParams``)."""
    return _he().HeParams(
        context.poly_modulus_degree, tuple(context.coeff_mod_bit_sizes), context.scale_bits
    )


class HeAudit(ModeAudit):
    """A homomorphic round: commitments, the custodian's decryption, its sum."""

    def __init__(self, attempt: Attempt, consulted: Consulted) -> None:
        super().__init__(attempt, consulted)
        self.commitments: dict[str, str] = {}  # member -> the ciphertext sha256 committed to
        self.decryption: wire.DecryptionStatement | None = None
        # re-derived from the decryption's plaintext (None without the archive, pruned,
        # or a hidden model no key here opens): the ring sum's sha256 and (Σ w·Δ, Σ w)
        self.sums: tuple[str, Any] | None = None

    def own_message(self, index: int, body: AcceptedEntry) -> bool:
        spec = self.attempt.spec
        if body.stage != "decrypt" or body.member != spec.custodian:
            return False
        # the custodian's decryption, kept as a message of the attempt
        self.consulted.identities.custodian_key(body.member)
        records = self.consulted.records
        if records.archive is not None:
            records.check(index, spec.round, f"decrypt from {body.member}", body.sha256)
        return True

    def on_message(self, body: AcceptedEntry, public: bytes) -> None:
        """A member's signed commitment to its ciphertext's hash, logged before any
        ciphertext of the attempt (a later one could be made from them)."""
        if body.stage != "commit":
            return
        if self.attempt.inputs:
            raise EntryProblem("a ciphertext commitment logged after a ciphertext")
        if body.member in self.commitments:
            raise EntryProblem(f"a second ciphertext commitment of {body.member}")
        if body.commitment is None or body.signature is None:
            raise EntryProblem("a ciphertext commitment without its hash and signature")
        wire.CiphertextCommitment(
            federation_id=self.consulted.identities.federation_id,
            round=body.round,
            attempt=body.attempt,
            member=body.member,
            vector_sha256=body.commitment,
            signature=body.signature,
        ).verify(public)
        self.commitments[body.member] = body.commitment

    def binding(self, member: str, digest: str) -> str:
        """The commitment set's digest, once the ciphertext is the one committed to."""
        if self.commitments.get(member) != digest:
            raise EntryProblem(
                f"{member}'s ciphertext is not one it committed to before the ciphertexts"
            )
        return wire.commitments_digest(self.commitments.items())

    def on_decryption(self, index: int, statement: wire.DecryptionStatement) -> None:
        """The custodian's decryption of this attempt's sum, then the sum re-derived.

        Raises:
            EntryProblem: a second one, another custodian's, an unpublished context,
                the wrong contributors, or a sum the archive does not give.
        """
        spec, where = self.attempt.spec, self.attempt.where
        if self.decryption is not None:
            raise EntryProblem(f"{where} was decrypted already")
        if statement.custodian != spec.custodian:
            raise EntryProblem(
                f"the decryption is by {statement.custodian}, but the signed spec of {where} "
                f"names custodian {spec.custodian or '(none)'}"
            )
        self.consulted.identities.verify_custodian(statement, "the decryption statement")
        logged = self.consulted.contexts.logged.get(spec.he_context_sha256)
        if logged is None:
            raise EntryProblem(
                f"the signed spec of {where} names CKKS context {spec.he_context_sha256[:16]}…, "
                "which no earlier he_context entry publishes"
            )
        context_index, context = logged
        if context.custodian != statement.custodian:
            raise EntryProblem(
                f"CKKS context {context.context_sha256[:16]}… was published by "
                f"{context.custodian} (log entry {context_index}), not by the decrypting "
                f"custodian {statement.custodian}"
            )
        self._check_contributors(statement)
        self.decryption = statement
        records = self.consulted.records
        if records.archive is None or records.pruned(spec.round):
            return  # a pruned round is listed when its archive_pruned entry is checked
        self.sums = self._rederive(index, statement, context)

    def _check_contributors(self, statement: wire.DecryptionStatement) -> None:
        """``contributors`` are the attempt's accepted masked inputs, each once, and enough."""
        where = self.attempt.where
        named = statement.contributors
        twice = sorted({m for m in named if named.count(m) > 1})
        if twice:
            raise EntryProblem(
                f"it counts {', '.join(twice)} more than once; each accepted contribution of "
                f"{where} enters the sum once"
            )
        at: dict[str, list[int]] = defaultdict(list)
        for index, member, _ in self.attempt.inputs:
            at[member].append(index)
        for member, indexes in sorted(at.items()):
            if len(indexes) > 1:
                raise EntryProblem(
                    f"{member} has {len(indexes)} accepted masked inputs in {where} "
                    f"(log entries {indexes}); a sum holds one per member"
                )
        strangers = sorted(set(named) - set(at))
        if strangers:
            raise EntryProblem(
                f"it names contributor(s) {', '.join(strangers)}, who have no accepted "
                f"masked input in {where}"
            )
        left_out = sorted(set(at) - set(named))
        if left_out:
            raise EntryProblem(
                f"the accepted masked input(s) of {', '.join(left_out)} (log entries "
                f"{sorted(i for m in left_out for i in at[m])}) are not among its contributors"
            )
        least = self.consulted.identities.min_agents
        if len(named) < least:
            raise EntryProblem(
                f"it decrypts a sum of {len(named)} contribution(s), fewer than the "
                f"federation's round.min_agents = {least}"
            )

    def _rederive(
        self, index: int, statement: wire.DecryptionStatement, context: wire.HeContextStatement
    ) -> tuple[str, Any] | None:
        """Re-add the archived ciphertexts, compare the digest, read the plaintext.

        Returns:
            (sha256 of the ring sum, (Σ w·Δ, Σ w)) from the released plaintext; None for
            a hidden model no key here opens.
        """
        spec, records = self.attempt.spec, self.consulted.records
        public = self.consulted.contexts.public(index, spec.round, context.context_sha256)
        values = spec.dim + 1
        # the ciphertext sum as the aggregator's session and the custodian add it
        total = CiphertextReplay(spec, public)
        for at, member, digest in self.attempt.inputs:
            raw = records.get(index, spec.round, f"masked_input from {member}", digest)
            try:
                total.add(raw)
            except FedsecError as exc:
                raise EntryProblem(
                    f"the archived ciphertext of {member} (log entry {at}) does not add "
                    f"under the federation's context: {exc.detail}"
                ) from None
        digest = total.digest()
        if digest != statement.sum_sha256:
            raise EntryProblem(
                f"re-adding the {total.count} archived ciphertexts of round {spec.round} "
                f"attempt {spec.attempt} gives sum digest {digest[:16]}…, but the custodian "
                f"decrypted a sum with digest {statement.sum_sha256[:16]}…"
            )
        plaintext = self._plaintext(index, statement)
        if plaintext is None:
            return None
        if len(plaintext) != values * 8:
            raise EntryProblem(
                f"the archived {_PLAINTEXT} is {len(plaintext)} bytes; {values} int64 values "
                f"are {values * 8}"
            )
        return _ring_sums(spec, plaintext, len(statement.contributors))

    def _plaintext(self, index: int, statement: wire.DecryptionStatement) -> bytes | None:
        """The released plaintext: archived, or sealed to the readers of a hidden model
        (None: no key here opens it)."""
        spec, records = self.attempt.spec, self.consulted.records
        if not statement.sealed:
            return records.get(index, spec.round, _PLAINTEXT, statement.plaintext_sha256)
        assert statement.sealed_sha256 is not None  # a sealed statement names it
        what = "sealed release of the custodian's decryption"
        rest = records.get(index, spec.round, what, statement.sealed_sha256)
        return self.consulted.models.open_hidden(spec, statement, rest, what)

    def check_survivors(self, body: AggregateEntry) -> None:
        spec, decryption = self.attempt.spec, self.decryption
        if decryption is None:
            raise EntryProblem(
                f"round {spec.round} attempt {spec.attempt} sums ciphertexts (secure_sum = he), "
                "but no he_decryption entry of the attempt precedes its aggregate"
            )
        if sorted(body.survivors) != sorted(decryption.contributors):
            raise EntryProblem(
                f"it names survivors {sorted(body.survivors)}, but the custodian decrypted the "
                f"sum of {sorted(decryption.contributors)}"
            )

    def rederive(self, index: int, body: AggregateEntry) -> Rederived:
        """(Σ w·Δ, Σ w) of the round, from its decryption's plaintext."""
        if self.sums is None:  # a hidden model no key here opens
            return Rederived()
        ring_digest, sums = self.sums
        if body.sum_sha256 != ring_digest:
            raise EntryProblem(
                f"sum_sha256 {body.sum_sha256[:16]}… is not the ring sum of the decrypted "
                f"plaintext ({ring_digest[:16]}…)"
            )
        return Rederived(sums)


def _ring_sums(spec: wire.RoundSpec, plaintext: bytes, contributors: int) -> tuple[str, Any]:
    """(sha256 of the ring sum, (Σ w·Δ, Σ w)) of a released integer sum, read exactly as
    the aggregator's HE session reads it (:meth:`fedsec.summation.he.HeSession.finalize`)."""
    ints = np.frombuffer(plaintext, dtype=he_release.PLAINTEXT_DTYPE)
    # (ints & ring_mask) as the ring's dtype: bit for bit the same for any int64, negative
    # ones and a 64-bit ring included
    ring = ring_from_integers(ints, spec.quant_spec())
    sums = codec_for(spec).decode_sum(ring, contributors)
    return hashlib.sha256(ring.tobytes()).hexdigest(), sums
