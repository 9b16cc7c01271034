"""Homomorphic summation (``secure_sum = "he"``): CKKS ciphertexts of the members'
quantized updates added without being opened (:mod:`fedsec.crypto.he`).  Stages: commit
(each member's signed hash of its ciphertext), masked_input (the ciphertexts), then
decrypt, where the key custodian releases the integer sum.

:class:`CiphertextReplay` is the one computation of the ciphertext sum: the aggregator's
session adds each ciphertext with it as it arrives, the key custodian re-adds the logged
ones with it before it decrypts, and :meth:`HeMode.replay` re-adds the archived ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from fedsec.crypto.quantize import ring_from_integers
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import (
    BadVector,
    DuplicateMessage,
    FedsecError,
    IntegrityError,
    PayloadError,
    ProtocolError,
    RoundAborted,
    UnknownMember,
    WrongStage,
)
from fedsec.protocol import he_release, wire
from fedsec.protocol.codec_choice import codec_for
from fedsec.protocol.roster import ID_PATTERN
from fedsec.protocol.stages import HE_STAGES, Stage
from fedsec.summation.mode import SessionInputs, StageWindow, SummationMode, upload_window
from fedsec.summation.session import (
    Decryption,
    StageMessage,
    SummationResult,
    SummationSession,
    decode_decryption,
    log,
)
from fedsec.summation.settings import FederationSettings

if TYPE_CHECKING:  # TenSEAL is the ``he`` extra's: only an he federation loads it
    from fedsec.crypto.he import CiphertextSum, HeParams, PublicContext


class CiphertextReplay:
    """The running sum of one attempt's ciphertexts (``spec.dim + 1`` values each: the
    quantized update and its weight), under the federation's public context.

    Args:
        spec: the attempt's signed spec.
        context: the public context its spec names.
    """

    def __init__(self, spec: wire.RoundSpec, context: PublicContext) -> None:
        from fedsec.crypto import he

        self.values = spec.dim + 1
        self.params: HeParams = context.params
        self._sum = he.CiphertextSum(context, context.params, self.values)

    @property
    def count(self) -> int:
        """How many contributions were added."""
        return self._sum.count

    def chunks(self, raw: bytes) -> list[bytes]:
        """One contribution's framed ciphertexts, split (count and lengths checked
        before anything is copied).

        Raises:
            PayloadError: a frame of the wrong count or length.
        """
        from fedsec.crypto import he

        return he.unframe_chunks(raw, self.params, self.values)

    def add(self, raw: bytes) -> None:
        """Add one contribution (as uploaded, framed); every chunk is checked against the
        context before any is added.

        Raises:
            PayloadError, CryptoError: not an encrypted update under the context.
        """
        self._sum.add(self.chunks(raw))

    @property
    def total(self) -> CiphertextSum:
        """The running sum itself (the key custodian adds and decrypts each contribution
        alone through it: ``fedsec.custodian.check.decrypt_contribution``)."""
        return self._sum

    def serialize(self) -> list[bytes]:
        """The sum's ciphertext chunks."""
        return self._sum.serialize()

    def digest(self) -> str:
        """The sum's SHA-256: what the custodian is offered and names when it decrypts."""
        return self._sum.digest()


def ciphertext_commitment(
    spec: wire.RoundSpec, member: str, body: wire.CommitBody
) -> wire.CiphertextCommitment:
    """The signed commitment ``member`` sent for ``spec``'s attempt (``body``: as posted)."""
    return wire.CiphertextCommitment(
        federation_id=spec.federation_id,
        round=spec.round,
        attempt=spec.attempt,
        member=member,
        vector_sha256=body.vector_sha256,
        signature=body.signature,
    )


class HeSession(SummationSession):
    """Homomorphic summation: the aggregator adds CKKS ciphertexts of the members'
    quantized vectors without opening them, and the key custodian decrypts only their
    sum, which becomes Σ w·Δ exactly as a SecAgg+ ring sum does.

    Args:
        spec: the attempt's signed spec (``he_context_sha256`` names ``context``).
        context: the federation's public CKKS context.
        custodian_key: the Ed25519 key of the custodian the spec names (roster).
        min_agents: fewest ciphertexts a sum may hold (the custodian checks it too).
        max_json_bytes: bound on a stored decryption statement, for :meth:`replay`.
        member_keys: member id -> Ed25519 key, for the cohort: commitments verify under it.
    """

    stages = HE_STAGES

    def __init__(
        self,
        spec: wire.RoundSpec,
        context: PublicContext,
        custodian_key: bytes,
        min_agents: int,
        max_json_bytes: int = 1 << 20,
        member_keys: Mapping[str, bytes] | None = None,
    ) -> None:
        super().__init__(spec)
        self.min_agents = min_agents
        self._member_keys = dict(member_keys or {})
        self.commitments: dict[str, wire.CiphertextCommitment] = {}
        # fixed when commit closes: the set every member binds into its statement
        self._commitment_set: wire.CommitmentSetBody | None = None
        self.commitments_sha256 = ""
        self.params = context.params
        self._custodian_key = custodian_key
        self._max_json_bytes = max_json_bytes
        self._sum = CiphertextReplay(spec, context)
        self.members: list[str] = []  # whose ciphertexts are in the sum, in arrival order
        # fixed when masked_input closes: what the custodian is asked to decrypt
        self.contributors: list[str] | None = None
        self.sum_sha256 = ""
        self.decryption: Decryption | None = None

    # -- commit: the ciphertexts' hashes, before any ciphertext ---------------------------------

    def _receive_commitment(self, message: wire.CiphertextCommitment) -> None:
        """Raises: WrongStage (commit closed), DuplicateMessage, UnknownMember (not in
        the cohort), ProtocolError (another attempt), SignatureError, PayloadError."""
        spec, member = self.spec, message.member
        if self._commitment_set is not None:
            raise WrongStage(f"{member}: the commitments of round {spec.round} closed")
        if member in self.commitments:
            raise DuplicateMessage(f"{member} already committed to its ciphertext")
        key = self._member_keys.get(member)
        if member not in spec.cohort or key is None:
            raise UnknownMember(f"{member} is not in the cohort of round {spec.round}")
        ours = (spec.federation_id, spec.round, spec.attempt)
        if (message.federation_id, message.round, message.attempt) != ours:
            raise ProtocolError(f"{member}'s commitment is for another round attempt")
        message.verify(key)
        self.commitments[member] = message

    def commitment_set(self, member: str) -> wire.CommitmentSetBody:
        if self._commitment_set is None or member not in self.commitments:
            return super().commitment_set(member)
        return self._commitment_set

    def _close_commit(self) -> None:
        if len(self.commitments) < self.min_agents:
            raise RoundAborted(
                f"round {self.spec.round}: {len(self.commitments)} members committed to a "
                f"ciphertext, need {self.min_agents}; missing: {self._uncommitted()}"
            )
        ordered = sorted(self.commitments.items())
        self._commitment_set = wire.CommitmentSetBody(
            [wire.MemberCommitment(m, c.vector_sha256, c.signature) for m, c in ordered]
        )
        self.commitments_sha256 = wire.commitments_digest((m, c.vector_sha256) for m, c in ordered)

    def _uncommitted(self) -> list[str]:
        return sorted(set(self.spec.cohort) - set(self.commitments))

    # -- masked_input: ciphertexts ----------------------------------------------------------------

    def receive(self, stage: str, message: StageMessage) -> None:
        """Raises: DuplicateMessage, WrongStage; for commit, see
        :meth:`_receive_commitment`; for masked_input, ProtocolError (the member did
        not commit), IntegrityError (not the committed bytes), PayloadError, CryptoError
        (a ciphertext that is not one of the federation's, checked before anything is
        added); for decrypt, see :meth:`_check_decryption`."""
        if stage == "commit" and isinstance(message, wire.CiphertextCommitment):
            self._receive_commitment(message)
        elif stage == "masked_input" and isinstance(message, MaskedInput):
            self._receive_ciphertexts(message)
        elif stage == "decrypt" and isinstance(message, Decryption):
            self._check_decryption(message)
            self.decryption = message
        else:
            raise ValueError(f"not a {stage} message: {type(message).__name__}")

    def _receive_ciphertexts(self, message: MaskedInput) -> None:
        member = message.member
        if member in self.members:
            raise DuplicateMessage(f"{member} already sent its encrypted update")
        if self.contributors is not None:
            raise WrongStage(f"{member}: the encrypted updates of round {self.spec.round} closed")
        if self._commitment_set is None:
            raise WrongStage(f"{member}: the commitments of round {self.spec.round} are open")
        committed = self.commitments.get(member)
        if committed is None:
            raise ProtocolError(
                f"{member} did not commit to a ciphertext in round {self.spec.round}: only "
                "committed ciphertexts are summed"
            )
        if hashlib.sha256(message.vector).hexdigest() != committed.vector_sha256:
            raise IntegrityError(
                f"{member}'s ciphertext is not the one it committed to "
                f"({committed.vector_sha256[:16]}…)"
            )
        self._sum.add(message.vector)
        self.members.append(member)

    def replay(self, stage: str, member: str, raw: bytes) -> None:
        if stage == "decrypt":
            self.receive(stage, decode_decryption(member, raw, self._max_json_bytes))
        elif stage == "commit":
            body = msgspec.json.decode(raw, type=wire.CommitBody)
            self.receive(stage, ciphertext_commitment(self.spec, member, body))
        else:
            self.receive(stage, MaskedInput(member, raw))

    def complete(self, stage: str) -> bool:
        if stage == "commit":
            return len(self.commitments) == len(self.spec.cohort)
        if stage == "masked_input":  # only a member that committed can upload
            return len(self.members) == len(self.commitments)
        return stage == "decrypt" and self.decryption is not None

    def close(self, stage: str) -> None:
        """Close commit (the commitment set is fixed) or masked_input (the contributors
        and the sum's digest are fixed).

        Raises:
            RoundAborted: fewer than ``min_agents`` commitments or ciphertexts arrived.
        """
        if stage == "commit":
            self._close_commit()
            return
        if stage != "masked_input":
            raise ValueError(f"stage {stage!r} is not closed by close()")
        if len(self.members) < self.min_agents:
            raise RoundAborted(
                f"round {self.spec.round}: {len(self.members)} encrypted updates arrived, need "
                f"{self.min_agents}; missing: {self._missing()}"
            )
        self.contributors = sorted(self.members)
        self.sum_sha256 = self._sum.digest()
        log.info(
            "event=he_sum_fixed round=%d attempt=%d contributors=%d sum_sha256=%s",
            self.spec.round,
            self.spec.attempt,
            len(self.contributors),
            self.sum_sha256[:16],
        )

    def _missing(self) -> list[str]:
        return sorted(set(self.spec.cohort) - set(self.members))

    # -- decrypt: the custodian's answer ----------------------------------------------------------

    def offer(self, log_index: int) -> wire.HeSumOffer:
        """What the custodian is asked to decrypt (``log_index``: the log's length now).

        Raises:
            WrongStage: the encrypted updates are still coming in.
        """
        if self.contributors is None:
            raise WrongStage(f"round {self.spec.round} has not fixed its ciphertext sum yet")
        return wire.HeSumOffer(
            federation_id=self.spec.federation_id,
            round=self.spec.round,
            attempt=self.spec.attempt,
            contributors=list(self.contributors),
            sum_sha256=self.sum_sha256,
            log_index=log_index,
        )

    def _check_decryption(self, message: Decryption) -> None:
        """Raises:
        WrongStage: the sum is not fixed yet.  DuplicateMessage: a decryption arrived.
        UnknownMember: the sender is not the spec's custodian.
        SignatureError: the statement is not signed by the custodian's roster key.
        ProtocolError: another federation, round, attempt, contributors or sum.
        PayloadError, IntegrityError: the plaintext's length or hash is not the
            statement's.  BadVector: a value no sum of the contributors can take.
        """
        spec, st = self.spec, message.statement
        if self.contributors is None:
            raise WrongStage(f"round {spec.round} has no ciphertext sum to decrypt yet")
        if self.decryption is not None:
            raise DuplicateMessage(f"round {spec.round} already has its decryption")
        if message.custodian != spec.custodian or st.custodian != spec.custodian:
            raise UnknownMember(
                f"{message.custodian} is not the key custodian of round {spec.round}"
            )
        st.verify(self._custodian_key)
        ours = (spec.federation_id, spec.round, spec.attempt)
        if (st.federation_id, st.round, st.attempt) != ours:
            raise ProtocolError(
                f"the decryption is for {st.federation_id} round {st.round} attempt "
                f"{st.attempt}, not {ours[0]} round {ours[1]} attempt {ours[2]}"
            )
        if st.contributors != self.contributors:
            raise ProtocolError(
                f"the decryption names contributors {st.contributors[:8]}, not the sum's "
                f"{self.contributors[:8]}"
            )
        if st.sum_sha256 != self.sum_sha256:
            raise ProtocolError(
                f"the decryption is of sum {st.sum_sha256[:16]}…, not {self.sum_sha256[:16]}…"
            )
        if st.sealed != spec.he_model_hidden:
            raise ProtocolError(
                f"round {spec.round} keeps the model "
                f"{'hidden from' if spec.he_model_hidden else 'visible to'} the aggregator; "
                f"the custodian sent a {'sealed' if st.sealed else 'plain'} decryption"
            )
        if message.sealed is not None:
            self._check_sealed(message)
            return
        expected = (spec.dim + 1) * he_release.PLAINTEXT_ITEM_BYTES
        if len(message.plaintext) != expected:
            raise PayloadError(
                f"the decrypted sum is {len(message.plaintext)} bytes; {spec.dim + 1} int64 "
                f"values are {expected}"
            )
        if hashlib.sha256(message.plaintext).hexdigest() != st.plaintext_sha256:
            raise IntegrityError(
                "the decrypted sum does not hash to the statement's plaintext_sha256"
            )
        ints = np.frombuffer(message.plaintext, dtype=he_release.PLAINTEXT_DTYPE)
        top = len(self.contributors) * spec.quant_spec().levels
        if int(ints.min()) < 0 or int(ints.max()) > top:
            raise BadVector(
                f"the decrypted sum holds values outside 0..{top}, which no sum of "
                f"{len(self.contributors)} quantized updates takes"
            )

    def _check_sealed(self, message: Decryption) -> None:
        """A hidden model's release: what the aggregator can check without reading it.

        Raises:
            ProtocolError: a field of a sealed statement missing, another parent than the
                spec's model, or a cohort member (or the custodian) not a recipient.
            IntegrityError: the release does not hash to ``sealed_sha256``, or its
                recipients are not the statement's.
        """
        spec, st, sealed = self.spec, message.statement, message.sealed
        assert sealed is not None
        if None in (st.ring_sha256, st.weight_sum, st.parent_version, st.sealed_sha256):
            raise ProtocolError(
                "a sealed decryption names ring_sha256, weight_sum, parent_version, "
                "model_sha256 and sealed_sha256"
            )
        if st.parent_version != spec.model_version:
            raise ProtocolError(
                f"the custodian derived the model from version {st.parent_version}; round "
                f"{spec.round} trained on version {spec.model_version}"
            )
        if hashlib.sha256(message.plaintext).hexdigest() != st.sealed_sha256:
            raise IntegrityError(
                "the sealed release does not hash to the statement's sealed_sha256"
            )
        if sorted(sealed.boxes) != st.recipients:
            raise IntegrityError("the sealed release's recipients are not the statement's")
        missing = sorted({*spec.cohort, spec.custodian} - set(st.recipients))
        if missing:
            raise ProtocolError(
                f"the sealed model is not sealed to {missing[:8]}: every cohort member and "
                "the custodian must be able to read it"
            )

    def finalize(self) -> SummationResult:
        """Raises RoundAborted: the custodian did not decrypt by the deadline."""
        spec = self.spec
        if self.decryption is None or self.contributors is None:
            raise RoundAborted(
                f"round {spec.round} attempt {spec.attempt}: the key custodian "
                f"{spec.custodian} did not decrypt within round.decrypt_s"
            )
        st = self.decryption.statement
        if st.sealed:  # checked whole in _check_sealed
            assert st.weight_sum is not None and st.ring_sha256 is not None
            return SummationResult(
                weighted_sum=np.zeros(0),
                weight_sum=st.weight_sum,
                survivors=list(self.contributors),
                dropped=self._missing(),
                sum_sha256=st.ring_sha256,
                sealed=self.decryption.body,
                parent_version=st.parent_version,
            )
        quant = spec.quant_spec()
        ints = np.frombuffer(self.decryption.plaintext, dtype=he_release.PLAINTEXT_DTYPE)
        # the ring sum SecAgg+ would have unmasked: the same integers, so the same bytes
        # (fedsec audit verify derives it the same way from the archived plaintext)
        ring = ring_from_integers(ints, quant)
        weighted, weight = codec_for(spec).decode_sum(ring, len(self.contributors))
        return SummationResult(
            weighted_sum=weighted,
            weight_sum=weight,
            survivors=list(self.contributors),
            dropped=self._missing(),
            sum_sha256=hashlib.sha256(ring.tobytes()).hexdigest(),
        )

    def participant_count(self) -> int:
        return len(self.members)


_WINDOWS: dict[str, StageWindow] = {
    # members train and encrypt before they commit to the hash
    "commit": upload_window,
    "masked_input": upload_window,
    "decrypt": lambda r, buffered: r.decrypt_s,
}


@dataclass(frozen=True)
class HeMode(SummationMode):
    """Homomorphic summation.  The custodian decrypts only sums of at least
    ``min_agents``; a sum of two would let each member read the other's update."""

    name: str = "he"
    stages: tuple[Stage, ...] = HE_STAGES
    windows: Mapping[str, StageWindow] = field(default_factory=lambda: dict(_WINDOWS))
    custodian_decrypts: bool = True

    def warm(self, cfg: FederationSettings, members: int) -> int:
        return 0  # CKKS ciphertexts: no packed ring vectors to unpack

    def capacity(self, cfg: FederationSettings) -> int:
        """The most members whose worst-case sum (each value up to the quantisation's
        L levels) CKKS holds exactly: n·L below ``HeParams.headroom``."""
        levels = (1 << cfg.round.quant_bits) - 1
        return int((he_params(cfg).headroom - 1) // levels)

    def model_problems(self, cfg: FederationSettings, params: int) -> list[str]:
        """A model whose encrypted update is larger than the aggregator accepts in one
        request (``server.max_body_bytes``) is refused: every round would end with each
        upload refused. Whole models are encrypted, never a chosen subset of layers: the
        layers left out would reach the aggregator in the clear (docs/security.md).
        Parameters the crypto layer refuses are :meth:`config_problems`' to report."""
        try:
            he = he_params(cfg)
        except (ModuleNotFoundError, FedsecError):
            return []
        chunks = he.chunks(params + 1)  # the weight travels as the last value
        upload = chunks * he.ciphertext_max_bytes
        limit = cfg.server.max_body_bytes
        if upload <= limit:
            return []
        return [
            f"round.secure_sum: he cannot sum this task's model of {params:,} parameters: "
            f"its encrypted update is {chunks:,} CKKS ciphertexts of up to "
            f"{he.ciphertext_max_bytes:,} bytes, {upload:,} bytes ({upload / 2**20:,.0f} MiB) "
            f"per member per round, over server.max_body_bytes ({limit:,}); at most "
            f'{_he_max_params(he, limit):,} parameters fit. Use secure_sum = "secagg" '
            "(about 1 byte a parameter) for a model this size"
        ]

    def config_problems(self, cfg: FederationSettings) -> list[str]:
        he, problems = cfg.he, []
        if not he.custodian:
            problems.append("he.custodian: expected the roster id of the key custodian, got ''")
        elif not ID_PATTERN.fullmatch(he.custodian):
            problems.append(
                "he.custodian: expected 1-64 characters of letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit, got {he.custodian!r}"
            )
        if not he.model_visible_to_aggregator:
            problems += _hidden_model_problems(cfg)
        if len(he.coeff_mod_bit_sizes) != 2:
            problems.append(
                "he.coeff_mod_bit_sizes: expected two moduli [data prime, special prime] "
                f"(sums need no rescaling level), got {list(he.coeff_mod_bit_sizes)}"
            )
        try:  # the parameters' one definition of validity is the crypto layer's
            he_params(cfg)
        except ModuleNotFoundError:
            problems.append("round.secure_sum: he needs TenSEAL: install fedsec with the he extra")
        except FedsecError as exc:
            problems.append(f"he: {exc.detail}")
        return problems

    def _open(self, spec: wire.RoundSpec, inputs: SessionInputs) -> HeSession:
        if spec.he_context_sha256 != inputs.he_context_sha256:
            raise ProtocolError(
                f"round {spec.round}'s spec names CKKS context "
                f"{spec.he_context_sha256[:16]}…, the workspace holds "
                f"{inputs.he_context_sha256[:16] or 'none'}…"
            )
        key = inputs.keys.get(spec.custodian)
        if inputs.he_context is None or key is None:
            raise ProtocolError(
                f"round {spec.round}: a homomorphic sum needs the published context and the "
                f"key custodian {spec.custodian!r} on the roster"
            )
        return HeSession(
            spec, inputs.he_context, key, inputs.min_agents, inputs.max_json_bytes, inputs.keys
        )


def _he_max_params(he: HeParams, limit: int) -> int:
    """The most parameters whose encrypted update (and weight) fits ``limit`` bytes."""
    return max(0, (limit // he.ciphertext_max_bytes) * he.slots - 1)


def he_params(cfg: FederationSettings) -> HeParams:
    """The federation's CKKS parameters (``[he]``).

    Raises:
        ModuleNotFoundError: TenSEAL is not installed (the ``he`` extra).
        FedsecError: parameters the crypto layer refuses.
    """
    from fedsec.crypto.he import HeParams

    he = cfg.he
    return HeParams(he.poly_modulus_degree, tuple(he.coeff_mod_bit_sizes), he.scale_bits)


def _hidden_model_problems(cfg: FederationSettings) -> list[str]:
    """The aggregator never holds a hidden model: it can neither score it, nor keep a
    server optimiser's state, nor pick a buffered round's newest base for it."""
    required: Sequence[tuple[bool, str, str, object]] = (
        (
            not cfg.validation.enabled,
            "validation.enabled",
            "false when he.model_visible_to_aggregator = false (the aggregator cannot "
            "read the model to score it)",
            cfg.validation.enabled,
        ),
        (
            cfg.server.optimizer == "fedavg",
            "server.optimizer",
            "fedavg when he.model_visible_to_aggregator = false (the custodian derives "
            "each hidden model and keeps no optimiser state)",
            cfg.server.optimizer,
        ),
        (
            cfg.round.mode == "sync",
            "round.mode",
            "sync when he.model_visible_to_aggregator = false (the custodian applies each "
            "sum to the version its round trained on)",
            cfg.round.mode,
        ),
    )
    return [
        f"{path}: expected {expected}, got {_show(got)}"
        for ok, path, expected, got in required
        if not ok
    ]


def _show(value: object) -> str:
    """A value as ``fedsec.config`` shows it in a problem (TOML spelling)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


HE = HeMode()
