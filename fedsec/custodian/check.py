"""The custodian's decision, sans-I/O: decrypt an offered sum only when the log proves it
is the sum of at least ``min_agents`` distinct accepted contributions, each once.

The aggregator's :class:`~fedsec.protocol.wire.HeSumOffer` is a claim, never trusted.
:class:`SumCheck` checks it against the verified log (:class:`LogFollower`) in three
steps, the I/O between them being the caller's:

1. on construction, everything the log alone decides: the log verifies and reaches the
   offer's index; the round is not one whose sum was already released; the attempt is
   open, its signed spec is an he round under this custodian's context, whose statement
   by this custodian is in the log; the offer's contributors are distinct, at least
   ``max(min_agents, the custodian's own floor)``, and exactly the attempt's accepted
   masked inputs, each a cohort member on the roster whose signed statement names the
   bytes; each the ciphertext its member committed to in stage commit, and each
   statement binding the digest of the attempt's whole logged commitment set; then
   :attr:`SumCheck.wanted` lists the archive objects to fetch;
2. :meth:`SumCheck.add` for each fetched object: its bytes hash to the logged digest and
   it adds to the re-computed sum (streaming, memory O(d)); then the contribution alone
   is decrypted, privately, and must be what an honest member encrypts: integers (within
   0.25) in the codec's range [0, 2^b - 1], and not the vector another contribution of
   the sum decrypts to;
3. :meth:`SumCheck.release`: the re-added sum's digest is the offer's; only then is the
   sum decrypted, rounded to integers (a value more than 0.25 from one, or outside what
   the members' quantized vectors can sum to, is a malformed contribution and nothing is
   released), and the unsigned :class:`~fedsec.protocol.wire.DecryptionStatement` made.

Why each contribution is opened: the log proves which signed ciphertexts are summed, not
what each encrypts.  A member colluding with the aggregator, which holds every ciphertext,
can upload ``Enc(0) - Σ`` of the other honest members' ciphertexts; the sum is then the
victim's ciphertext alone, with any number of honest members in it.  Such a contribution
decrypts to negative values and is refused; one within the range can cancel at most the
colluder's own share of the sum (docs/threat-model.md).  A shifted cancellation
``Enc(c) − Σ`` that stays in the range needs the others' ciphertexts before the colluder's
own is fixed: the commit step rules that out (every member commits to its ciphertext's
hash before any ciphertext is accepted or served, and binds the digest of the commitment
set it was shown, so a commitment logged after the honest ciphertexts is refused).

Any failure raises :class:`Refused` with a machine ``reason``.  Nothing is decrypted
before the log decided the offer's contributors and a contribution's bytes are the logged
ones; the sum is decrypted only after step 3's digest comparison passed.  A refusal that
follows a decryption says which rule and whose contribution, never a decrypted value nor
how far one is from an integer: such output is what the IND-CPA-D attacks on CKKS (Li and
Micciancio, 2021) feed on.  :func:`decide` runs the three steps with a synchronous
archive reader.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from fedsec.crypto import he
from fedsec.crypto.he import decrypt_sum
from fedsec.custodian.follow import (
    LogFollower,
    LoggedCommitment,
    LoggedContribution,
    custodian_decrypts,
)
from fedsec.errors import FedsecError
from fedsec.protocol.limits import MIN_SECURE_SUM
from fedsec.protocol.wire import (
    DecryptionStatement,
    HeContextStatement,
    HeSumOffer,
    RoundSpec,
    commitments_digest,
)
from fedsec.summation.he import CiphertextReplay

__all__ = [
    "DECRYPTION_REASONS",
    "MAX_DECRYPTION_REFUSALS",
    "MIN_CONTRIBUTORS",
    "ROUNDING_TOLERANCE",
    "Custody",
    "LogFollower",
    "Reason",
    "Refused",
    "Release",
    "Released",
    "SumCheck",
    "check_quantized",
    "decide",
    "decrypt_contribution",
]

#: A decrypted value further than this from an integer was not a sum of integers: CKKS's
#: error on a sum of fresh ciphertexts is ~1e-8 (design: "the custodian refuses a sum with
#: any value more than 0.25 from an integer"), so only a malformed contribution gets here.
ROUNDING_TOLERANCE: Final = 0.25
#: The custodian's own floor on contributors, whatever the genesis says: with two, each
#: member reads the other's update from the aggregate; fedsec.config requires
#: round.min_agents >= 3 for he, and a genesis the aggregator writes cannot lower it here.
MIN_CONTRIBUTORS: Final = MIN_SECURE_SUM

Reason = Literal[
    "bad_log",
    "log_incomplete",
    "bad_offer",
    "already_released",
    "attempt_over",
    "not_he_round",
    "wrong_context",
    "too_few",
    "counted_twice",
    "unknown_contributor",
    "forged_contribution",
    "not_committed",
    "commitments_differ",
    "not_logged_sum",
    "archive_mismatch",
    "bad_ciphertext",
    "not_integral",
    "out_of_range",
    "repeated_contribution",
    "bad_parent",
]
#: The refusals a decryption decided: each tells whoever made the offer one fact about
#: plaintexts it cannot read, so the service stops after a few (IND-CPA-D).
DECRYPTION_REASONS: Final[frozenset[Reason]] = frozenset(
    {"not_integral", "out_of_range", "repeated_contribution"}
)
#: Refusals decided by a decryption tolerated before the service stops: honest members
#: never cause one (a refusal means a buggy or hostile member, or an aggregator probing
#: the key), a retry after one honest mistake still fits, and an attacker gets a handful
#: of one-bit answers where the IND-CPA-D attacks on CKKS need many decryption outputs.
MAX_DECRYPTION_REFUSALS: Final = 3


class Refused(FedsecError):
    """The custodian refuses to decrypt an offered sum; ``reason`` says which rule failed."""

    code = "decryption_refused"
    http_status = 409

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason: Reason = reason


@dataclass(frozen=True, slots=True)
class Custody:
    """Who the custodian is and what it holds.

    Args:
        federation_id: the federation it serves.
        custodian_id: its roster id (round specs must name it).
        public_key: its roster key (its ``he_context`` statement must verify under it).
        context_sha256: SHA-256 of its public context bytes.
        public_ctx: the public context, to re-add ciphertexts.
        secret_ctx: the secret context; used only by :meth:`SumCheck.release`.
        min_contributors: its own floor, on top of the genesis's ``min_agents``.
    """

    federation_id: str
    custodian_id: str
    public_key: bytes
    context_sha256: str
    public_ctx: he.PublicContext
    secret_ctx: he.SecretContext
    min_contributors: int = MIN_CONTRIBUTORS

    @property
    def params(self) -> he.HeParams:
        return self.public_ctx.params


class Released(NamedTuple):
    """A decryption the custodian released (its own record of it)."""

    round: int
    attempt: int
    sum_sha256: str
    contributors: tuple[str, ...]


class Release(NamedTuple):
    """What the custodian releases: the plaintext (``<i8``) and its unsigned statement."""

    plaintext: bytes
    statement: DecryptionStatement


class SumCheck:
    """One offer under check (see the module docstring for the three steps).

    Args:
        offer: what the aggregator asks to be decrypted.
        follower: the verified log, read at least up to ``offer.log_index``.
        custody: who the custodian is.
        released: its earlier releases: the same attempt and sum is answered again (the
            plaintext is the same), but no other sum of a round that shares a member
            with a sum already released of that round.

    Raises:
        Refused: any rule the log alone decides.
    """

    def __init__(
        self,
        offer: HeSumOffer,
        follower: LogFollower,
        custody: Custody,
        released: Sequence[Released] = (),
    ) -> None:
        self.offer = offer
        self._custody = custody
        _check_log(offer, follower, custody)
        _check_history(offer, released)
        self.spec = _check_spec(offer, follower, custody)
        self.floor = max(follower.min_agents, custody.min_contributors)
        self.wanted: tuple[LoggedContribution, ...] = _check_contributors(
            offer, follower, self.floor
        )
        _check_commitments(
            self.wanted, follower.commitments_of(offer.round, offer.attempt, offer.log_index)
        )
        self.dim = self.spec.dim + 1  # the quantized update and its weight
        params = custody.params
        self._max_bytes = 4 + params.chunks(self.dim) * (4 + params.ciphertext_max_bytes)
        for logged in self.wanted:
            if not 0 < logged.bytes <= self._max_bytes:
                raise Refused(
                    "bad_ciphertext",
                    f"{logged.member}'s logged contribution is {logged.bytes} bytes; an "
                    f"encrypted update of {self.dim} values is at most {self._max_bytes}",
                )
        # the ciphertext sum as the aggregator's session adds it (fedsec.summation.he)
        self._sum = CiphertextReplay(self.spec, custody.public_ctx)
        self._added: set[str] = set()
        # member by the SHA-256 of the integer vector its contribution decrypts to
        self._vectors: dict[str, str] = {}

    def add(self, logged: LoggedContribution, raw: bytes) -> None:
        """Add one fetched archive object, the contribution ``logged`` names, and check
        what it encrypts (see the module docstring).

        Raises:
            Refused: ``logged`` is not wanted or already added, the bytes are not the
                logged ones, they are not an encrypted update under the context, or it
                does not decrypt to an integer vector in the codec's range that no other
                contribution of the sum decrypts to.
        """
        if logged not in self.wanted or logged.member in self._added:
            raise Refused("counted_twice", f"{logged.member}'s contribution is added twice")
        if len(raw) != logged.bytes or hashlib.sha256(raw).hexdigest() != logged.sha256:
            raise Refused(
                "archive_mismatch",
                f"the archive object of {logged.member}'s contribution (log entry "
                f"{logged.index}) is not the logged bytes {logged.sha256[:16]}…",
            )
        try:
            chunks = self._sum.chunks(raw)
            values = decrypt_contribution(self._sum.total, chunks, self._custody.secret_ctx)
        except FedsecError as exc:
            raise Refused(
                "bad_ciphertext", f"{logged.member}'s contribution does not add: {exc.detail}"
            ) from None
        self._added.add(logged.member)
        self._check_contribution(logged.member, values)

    def _check_contribution(self, member: str, values: he.FloatVector) -> None:
        """:func:`check_quantized`, then the vector must be no other contribution's.

        Raises:
            Refused: see :func:`check_quantized`; ``repeated_contribution``.
        """
        digest = check_quantized(values, self.spec.quant_bits, member)
        earlier = self._vectors.get(digest)
        if earlier is not None:
            raise Refused(
                "repeated_contribution",
                f"{member}'s contribution decrypts to the same vector as {earlier}'s: "
                "a copy counts one member's update twice",
            )
        self._vectors[digest] = member

    def release(self) -> Release:
        """Compare the re-added sum with the offer; only then decrypt and round it.

        Raises:
            Refused: a wanted contribution was not added, the digest is not the offer's,
                or the decrypted values are not integers the contributions can sum to.
        """
        missing = sorted(c.member for c in self.wanted if c.member not in self._added)
        if missing:
            raise Refused("archive_mismatch", f"contributions of {missing} were not re-added")
        chunks = self._sum.serialize()
        digest = he.sum_digest(chunks)
        if digest != self.offer.sum_sha256:
            raise Refused(
                "not_logged_sum",
                f"the offered sum {self.offer.sum_sha256[:16]}… is not the sum of the logged "
                f"contributions, which re-adds to {digest[:16]}…",
            )
        values = decrypt_sum(self._custody.secret_ctx, chunks, self.dim)
        plaintext = self._integers(values).astype("<i8").tobytes()
        statement = DecryptionStatement(
            federation_id=self.offer.federation_id,
            round=self.offer.round,
            attempt=self.offer.attempt,
            custodian=self._custody.custodian_id,
            contributors=sorted(self.offer.contributors),
            sum_sha256=digest,
            plaintext_sha256=hashlib.sha256(plaintext).hexdigest(),
        )
        return Release(plaintext, statement)

    def _integers(self, values: he.FloatVector) -> npt.NDArray[np.int64]:
        """The decrypted values as integers, each the sum of ``n`` values in [0, 2^b - 1].

        Raises:
            Refused: a value off an integer, or beyond what the contributions can sum to.
        """
        rounded: he.FloatVector = np.rint(values)
        if not float(np.max(np.abs(values - rounded))) <= ROUNDING_TOLERANCE:  # NaN too
            raise Refused(  # how far, never: IND-CPA-D feeds on decryption output
                "not_integral",
                f"the decrypted sum has a value further than {ROUNDING_TOLERANCE} from an "
                "integer: a contribution was not an integer vector",
            )
        top = len(self.wanted) * ((1 << self.spec.quant_bits) - 1)
        if float(rounded.min()) < 0 or float(rounded.max()) > top:
            raise Refused(
                "out_of_range",
                f"the decrypted sum leaves [0, {top}], what {len(self.wanted)} quantized "
                f"vectors of {self.spec.quant_bits} bits sum to",
            )
        return rounded.astype(np.int64)


def decrypt_contribution(
    total: he.CiphertextSum, chunks: Sequence[bytes], secret_ctx: he.SecretContext
) -> he.FloatVector:
    """Re-add one member's contribution to ``total`` and decrypt it alone, for
    :class:`SumCheck` only (kept apart from :func:`decrypt_sum`, the release's decryption,
    so that each use of the secret context is named).

    Raises:
        PayloadError, CryptoError: see :meth:`~fedsec.crypto.he.CiphertextSum.add`.
    """
    return total.add_and_decrypt(chunks, secret_ctx)


def check_quantized(values: he.FloatVector, quant_bits: int, member: str) -> str:
    """Check that ``member``'s decrypted contribution is what an honest member encrypts:
    its quantized vector, integers in [0, 2^b - 1] (the weight slot included).

    Returns:
        A SHA-256 of the integer vector, to tell a repeat; never the vector.

    Raises:
        Refused: ``not_integral`` (a value further than :data:`ROUNDING_TOLERANCE` from an
            integer, or NaN) or ``out_of_range``.  The detail names the member, never a
            value nor a distance.
    """
    rounded: he.FloatVector = np.rint(values)
    if not float(np.max(np.abs(values - rounded))) <= ROUNDING_TOLERANCE:  # NaN too
        raise Refused(
            "not_integral",
            f"{member}'s contribution does not decrypt to an integer vector: it is not a "
            "quantized update",
        )
    levels = (1 << quant_bits) - 1
    if float(rounded.min()) < 0 or float(rounded.max()) > levels:
        raise Refused(
            "out_of_range",
            f"{member}'s contribution decrypts to values outside [0, {levels}], the range "
            f"of a {quant_bits}-bit quantized update: it cancels or inflates other "
            "contributions",
        )
    # in range, so exact in 16 bits (a spec's quant_bits is at most 16, checked on
    # construction): a quarter of the bytes int64 would hash
    return hashlib.sha256(
        rounded.astype("<u2" if quant_bits <= 16 else "<u4").tobytes()
    ).hexdigest()


def _check_log(offer: HeSumOffer, follower: LogFollower, custody: Custody) -> None:
    if follower.broken is not None:
        raise Refused("bad_log", f"the log does not verify: {follower.broken.detail}")
    if offer.federation_id != custody.federation_id:
        raise Refused("bad_offer", f"the offer is for federation {offer.federation_id!r}")
    if follower.next_index < offer.log_index:
        raise Refused(
            "log_incomplete",
            f"the offer cites the log up to entry {offer.log_index}, but the aggregator "
            f"served only {follower.next_index} entries",
        )


def _check_history(offer: HeSumOffer, released: Sequence[Released]) -> None:
    """Two sums of one round over overlapping members give their difference, e.g. one
    member's update when a retry left one member out (members may contribute the same
    update to every attempt of a round).  The same sum again gives nothing new."""
    for earlier in released:
        if earlier.round != offer.round:
            continue
        if (earlier.attempt, earlier.sum_sha256) == (offer.attempt, offer.sum_sha256):
            continue
        shared = sorted(set(earlier.contributors) & set(offer.contributors))
        if shared:
            raise Refused(
                "already_released",
                f"round {offer.round} already had a sum released (attempt {earlier.attempt}) "
                f"with {shared}; another sum of theirs could be subtracted from it",
            )


def _check_spec(offer: HeSumOffer, follower: LogFollower, custody: Custody) -> RoundSpec:
    key = (offer.round, offer.attempt)
    what = f"round {offer.round} attempt {offer.attempt}"
    if key in follower.closed:
        raise Refused("attempt_over", f"{what} is over (log: {follower.closed[key]})")
    spec = follower.specs.get(key)
    if spec is None:
        raise Refused("not_he_round", f"the log holds no signed spec of {what}")
    if not custodian_decrypts(spec):
        raise Refused("not_he_round", f"{what} sums with {spec.secure_sum!r}, not he")
    if spec.custodian != custody.custodian_id:
        raise Refused("wrong_context", f"{what} names custodian {spec.custodian!r}")
    if spec.he_context_sha256 != custody.context_sha256:
        raise Refused(
            "wrong_context",
            f"{what} encrypts under context {spec.he_context_sha256[:16]}…, not this "
            f"custodian's {custody.context_sha256[:16]}…",
        )
    try:
        spec.quant_spec()  # the range each contribution is checked against
    except FedsecError as exc:
        raise Refused(
            "not_he_round", f"{what} quantizes in no way members do: {exc.detail}"
        ) from None
    if not any(_is_ours(s, custody) for s in follower.contexts):
        raise Refused(
            "wrong_context", "the log holds no he_context statement of this custodian's context"
        )
    return spec


def _is_ours(statement: HeContextStatement, custody: Custody) -> bool:
    params = custody.params
    mine = (
        custody.federation_id,
        custody.custodian_id,
        custody.context_sha256,
        params.poly_modulus_degree,
        list(params.coeff_mod_bit_sizes),
        params.scale_bits,
    )
    logged = (
        statement.federation_id,
        statement.custodian,
        statement.context_sha256,
        statement.poly_modulus_degree,
        statement.coeff_mod_bit_sizes,
        statement.scale_bits,
    )
    if logged != mine:
        return False
    try:
        statement.verify(custody.public_key)
    except FedsecError:
        return False
    return True


def _check_contributors(
    offer: HeSumOffer, follower: LogFollower, floor: int
) -> tuple[LoggedContribution, ...]:
    offered = offer.contributors
    repeated = sorted({m for m in offered if offered.count(m) > 1})
    if repeated:
        raise Refused("counted_twice", f"the offer counts {repeated} more than once")
    if len(offered) < floor:
        raise Refused(
            "too_few", f"the offer sums {len(offered)} contributions; at least {floor} are needed"
        )
    logged = list(follower.contributions(offer.round, offer.attempt, below=offer.log_index))
    _check_distinct(logged)
    by_member = {c.member: c for c in logged}
    unknown = sorted(set(offered) - set(by_member))
    if unknown:
        raise Refused("unknown_contributor", f"{unknown} have no accepted contribution in the log")
    left_out = sorted(set(by_member) - set(offered))
    if left_out:
        raise Refused(
            "not_logged_sum",
            f"the offer leaves out the accepted contributions of {left_out}: it is not the "
            "attempt's logged sum",
        )
    wanted = tuple(by_member[m] for m in sorted(offered))
    for contribution in wanted:
        if contribution.problem is not None:
            raise Refused(
                contribution.problem,
                f"log entry {contribution.index}: {contribution.detail}",
            )
    return wanted


def _check_commitments(
    wanted: Sequence[LoggedContribution], commitments: Sequence[LoggedCommitment]
) -> None:
    """Every commitment of the attempt is its member's, once; every contribution's
    statement binds the digest of that whole set.  A commitment logged after some
    ciphertexts (a colluder's, made from them) changes the digest the later statements
    bind, so the earlier ones disagree with it.  (That each contribution is the
    committed ciphertext, the follower checked as it read it: ``not_committed``.)"""
    members = [c.member for c in commitments]
    twice = sorted({m for m in members if members.count(m) > 1})
    if twice:
        raise Refused("counted_twice", f"the log holds more than one commitment of {twice}")
    for commitment in commitments:
        if commitment.problem is not None:
            raise Refused(commitment.problem, f"log entry {commitment.index}: {commitment.detail}")
    digest = commitments_digest((c.member, c.vector_sha256) for c in commitments)
    for contribution in wanted:
        if contribution.commitments_sha256 != digest:
            raise Refused(
                "commitments_differ",
                f"log entry {contribution.index}: {contribution.member}'s statement binds "
                f"commitment set {contribution.commitments_sha256[:16] or 'none'}…, not the "
                f"attempt's logged set {digest[:16]}… (a commitment was logged after a "
                "ciphertext, or members were shown different sets)",
            )


def _check_distinct(logged: Collection[LoggedContribution]) -> None:
    members = [c.member for c in logged]
    digests = [c.sha256 for c in logged]
    twice = sorted({m for m in members if members.count(m) > 1})
    if twice:
        raise Refused("counted_twice", f"the log accepts more than one contribution of {twice}")
    if len(set(digests)) != len(digests):
        raise Refused("counted_twice", "the log accepts the same ciphertext from two members")


def decide(
    offer: HeSumOffer,
    follower: LogFollower,
    fetch_archive: Callable[[str], bytes],
    custody: Custody,
    *,
    released: Sequence[Released] = (),
) -> Release:
    """Check ``offer`` and, when every rule holds, decrypt it (the three steps of
    :class:`SumCheck`, reading each archive object with ``fetch_archive(sha256)``).

    Returns:
        The plaintext and the unsigned decryption statement.

    Raises:
        Refused: a rule failed; nothing was released (nothing was decrypted unless the
            log decided the contributors and their bytes were the logged ones).
    """
    check = SumCheck(offer, follower, custody, released)
    for logged in check.wanted:
        try:
            raw = fetch_archive(logged.sha256)
        except FedsecError as exc:
            raise Refused(
                "archive_mismatch",
                f"the archive object of {logged.member}'s contribution is not served: {exc.detail}",
            ) from None
        check.add(logged, raw)
    return check.release()
