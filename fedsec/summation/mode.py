"""A summation mode: everything every party needs to know about one way of summing.

A :class:`SummationMode` is a frozen value (one per ``secure_sum`` value, registered in
:data:`fedsec.summation.MODES`).  It owns the mode's stages and each stage's deadline,
its cohort bounds and neighbour graph, its configuration problems, opening its session,
and :meth:`SummationMode.replay`: the one computation of an attempt's sum from its
stored messages, which crash resume, ``fedsec audit verify`` and the key custodian call
instead of summing again by their own code.  The round engine, the simulation and the
custodian ask the mode object; none of them compares ``secure_sum`` with a value.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from fedsec.crypto import packing
from fedsec.errors import FedsecError, ProtocolError
from fedsec.protocol import compat, wire
from fedsec.protocol.compat import SummationTraits
from fedsec.protocol.ring_width import ring_bits_for
from fedsec.protocol.stages import Stage
from fedsec.summation.session import ReferenceUpdate, SummationResult, SummationSession
from fedsec.summation.settings import FederationSettings, RoundSettings

if TYPE_CHECKING:  # TenSEAL is the ``he`` extra's: only an he federation loads it
    from fedsec.crypto.he import PublicContext
    from fedsec.summation.served_group import GroupHosts

#: A stage's window in seconds from its start, given ``[round]`` and whether the
#: federation runs buffered rounds.
StageWindow = Callable[[RoundSettings, bool], float]


def upload_window(r: RoundSettings, buffered: bool) -> float:
    """The window of a stage members upload their update in.  Buffered members trained
    before joining; sync members train now (while, in SecAgg+, they advertise and share
    keys), so training time is part of the upload stage in both modes."""
    return r.masked_s + (0.0 if buffered else r.open_s)


@dataclass(frozen=True, slots=True)
class SessionInputs:
    """What opening a session takes besides the signed spec.

    Attributes:
        keys: member id -> Ed25519 public key, for the cohort (and, in a mode where a
            custodian decrypts, the custodian the spec names).
        min_agents: fewest contributions a sum may hold (``round.min_agents``; the
            genesis entry's copy for the auditor).
        he_context: the federation's public CKKS context (homomorphic modes).
        he_context_sha256: its SHA-256, which the spec must name.
        max_json_bytes: bound on a stored decryption statement (``server.max_json_bytes``).
        reference: FLTrust's reference update (trusted mode with rule ``fltrust``).
        shard_workers: a sharded attempt's groups each in a worker process of its own
            (``round.shard_workers``; the aggregator's sessions only: a replay sums in
            this process).
        stored: the attempt's accepted messages of the given stages, as the state store
            holds them: a group's worker started again is rebuilt from them.
        group_hosts: the attempt's group servers (``round.group_servers``), as the
            store knows them: a group the spec gives a server URL is read from the
            store (:class:`~fedsec.summation.served_group.ServedGroup`; the aggregator's
            sessions only).
    """

    keys: Mapping[str, bytes]
    min_agents: int
    he_context: PublicContext | None = None
    he_context_sha256: str = ""
    max_json_bytes: int = 1 << 20
    reference: ReferenceUpdate | None = None
    shard_workers: bool = False
    stored: Callable[[Sequence[str]], Sequence[StoredMessage]] | None = None
    group_hosts: GroupHosts | None = None


class StoredMessage(NamedTuple):
    """One accepted stage message as stored: the state store's row or the archived object
    the log's ``accepted`` entry names.  ``raw`` is the request body as accepted: the
    JSON body of a key, consistency, unmask or commit stage; the packed vector (or the
    framed ciphertexts) of masked_input; the custodian's whole ``post_decryption`` body
    of decrypt."""

    stage: str
    member: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class StoredAttempt:
    """An attempt's accepted messages, as :meth:`SummationMode.replay` takes them.

    Attributes:
        inputs: what the session opens with (keys, ``min_agents``, the CKKS context...).
        messages: every accepted stage message of the attempt, in the order accepted
            (the log's order; stages never interleave), each one :class:`StoredMessage`.
    """

    inputs: SessionInputs
    messages: Sequence[StoredMessage]


@dataclass(frozen=True)
class SummationMode(ABC):
    """One way of summing (see the module docstring).

    Attributes:
        name: the ``secure_sum`` value (spec and ``round.secure_sum``).
        stages: its message stages after open, in order; the last ends in finalize.
        windows: each stage's deadline from its start (:func:`stage_seconds`).
        commits_graph: members commit to the neighbour graph's randomness when joining.
        custodian_decrypts: a key custodian publishes a public CKKS context before any
            cohort is fixed and decrypts each sum; members commit to their ciphertexts.
        held_answers: upload stage -> the stage whose data a held upload answer carries
            (SecAgg+: the masked input's answer waits for the consistency stage).
        shards: a spec may split its cohort into groups, each summed by a session of its
            own (:mod:`fedsec.summation.sharded`).
    """

    name: str
    stages: tuple[Stage, ...]
    windows: Mapping[str, StageWindow]
    commits_graph: bool = False
    custodian_decrypts: bool = False
    held_answers: Mapping[str, Stage] = field(default_factory=dict)
    shards: bool = False

    # -- what the protocol's feature rules know of it (fedsec.protocol.compat) --------------

    @property
    def traits(self) -> SummationTraits:
        """The mode's traits in the protocol's compatibility table (one definition, which
        config and spec checks read too).

        Raises:
            ProtocolError: the table has no such mode.
        """
        return compat.traits(self.name)

    @property
    def min_members(self) -> int:
        """The least ``round.min_agents`` (and contributions to one revealed sum) it allows."""
        return self.traits.min_contributors

    @property
    def sums_in_clear(self) -> bool:
        """The aggregator sees each member's update (robust rules need it; the archive then
        holds updates in the clear)."""
        return self.traits.sees_updates

    @property
    def carries_ddp(self) -> bool:
        """Members' distributed-DP noise shares sum exactly in its ring."""
        return self.traits.sums_in_ring

    # -- stages ------------------------------------------------------------------------------

    def stage_seconds(self, stage: str, r: RoundSettings, buffered: bool) -> float:
        """Seconds ``stage`` may last from its start (inf for a stage it has no window for)."""
        window = self.windows.get(stage)
        return math.inf if window is None else window(r, buffered)

    def spec_deadlines(self, r: RoundSettings) -> dict[str, float]:
        """The deadlines a signed spec carries (the fields every mode's specs had, plus
        ``decrypt_s`` where the mode decrypts: other specs keep their exact fields)."""
        deadlines = {
            "train_s": r.open_s,
            "advertise_s": r.advertise_s,
            "share_keys_s": r.share_s,
            "masked_input_s": r.masked_s,
            "unmask_s": r.unmask_s,
        }
        if "decrypt" in self.stages:
            deadlines["decrypt_s"] = r.decrypt_s
        return deadlines

    # -- start-up ----------------------------------------------------------------------------

    def warm(self, cfg: FederationSettings, members: int) -> int:
        """Load the compiled loops that (un)pack uploads at every ring width a cohort of
        ``cfg``'s bounds drawn from ``members`` can have, before the aggregator serves: the
        first upload of a process otherwise waits on the event loop for numba's start-up
        (about 0.3 s, every request of the moment behind it).  A mode whose uploads are
        not ring vectors overrides it with nothing.  Returns the loops run."""
        r = cfg.round
        least = max(min(r.min_agents, members), 1)
        most = max(min(r.max_agents, members), least)
        headroom = cfg.codec.headroom_bits
        widths = range(
            ring_bits_for(r.quant_bits, least, headroom),
            ring_bits_for(r.quant_bits, most, headroom) + 1,
        )
        return packing.warm(widths)

    # -- cohort ------------------------------------------------------------------------------

    def capacity(self, cfg: FederationSettings) -> int | None:
        """The most members one sum can hold, or None for no bound of the mode's own."""
        return None

    def graph(self, n: int, r: RoundSettings) -> tuple[int, int]:
        """(neighbours k, threshold t) of a cohort of ``n``; (0, 0) without a graph."""
        return 0, 0

    def config_problems(self, cfg: FederationSettings) -> list[str]:
        """``key: expected ..., got ...`` sentences for the settings this mode refuses."""
        return []

    def model_problems(self, cfg: FederationSettings, params: int) -> list[str]:
        """Sentences for a task model of ``params`` trainable parameters that this mode
        cannot sum under ``cfg`` (known once the task is: at init and at start)."""
        return []

    # -- sessions ----------------------------------------------------------------------------

    def open_session(self, spec: wire.RoundSpec, inputs: SessionInputs) -> SummationSession:
        """The session of ``spec``'s attempt.

        Raises:
            ProtocolError: an aggregation rule where the mode sees no single update; the
                mode's own (e.g. a context or custodian key missing).
        """
        self.check_rule(spec)
        if spec.groups and not self.shards:
            raise ProtocolError(
                f"round {spec.round}: {len(spec.groups)} shard groups, but {self.name} "
                "sums a round in one session"
            )
        return self._open(spec, inputs)

    def check_rule(self, spec: wire.RoundSpec) -> None:
        """Raises ProtocolError: the spec names an aggregation rule, which needs the
        individual updates, and this mode does not show the aggregator any."""
        if spec.aggregation is not None and not self.sums_in_clear:
            raise ProtocolError(
                f"round {spec.round}: aggregation rule {spec.aggregation.rule} needs a "
                f"trusted aggregator (secure_sum none): with {self.name} no single update "
                "is visible"
            )

    @abstractmethod
    def _open(self, spec: wire.RoundSpec, inputs: SessionInputs) -> SummationSession:
        """The mode's session (the checks common to every mode passed)."""

    def replay(self, spec: wire.RoundSpec, stored: StoredAttempt) -> SummationResult:
        """The attempt's sum, recomputed from its stored messages exactly as the
        aggregator's session computed it when they arrived.

        Args:
            spec: the attempt's signed spec.
            stored: its accepted messages and the session's inputs (:class:`StoredAttempt`).

        Returns:
            What the session's finalize returns: ``sum_sha256`` is the hash the log's
            ``aggregate`` entry names.

        Raises:
            ProtocolError: a stored message no longer verifies (its detail names it), or
                one of a stage the mode does not have or that came after a later stage.
            msgspec.DecodeError: a stored JSON body no longer decodes.
            RoundAborted, RecoveryImpossible: the messages cannot form a sum.
        """
        session = self.open_session(spec, stored.inputs)
        feed(session, stored.messages)
        return session.finalize()


def feed(
    session: SummationSession, messages: Iterable[StoredMessage], through: str | None = None
) -> None:
    """Replay accepted ``messages`` into ``session``, closing each stage before the first
    message of a later one, then every stage before ``through`` (None: every stage but
    the last, so that :meth:`~SummationSession.finalize` follows).

    Raises:
        ProtocolError: a message no longer verifies; a stage not the session's, or one
            before a stage already closed; ``through`` not a stage of the session.
        msgspec.DecodeError: a stored JSON body no longer decodes.
    """
    order = session.stages
    at = 0
    for stage, member, raw in messages:
        if stage not in order or order.index(stage) < at:  # type: ignore[arg-type,unused-ignore]
            raise ProtocolError(
                f"a stored {stage} message from {member} comes after stage {order[at]}"
            )
        while order[at] != stage:
            session.close(order[at])
            at += 1
        try:
            session.replay(stage, member, raw)
        except FedsecError as exc:
            raise ProtocolError(
                f"the stored {stage} message from {member} no longer verifies: {exc.detail}"
            ) from None
    if through is not None and through not in order:
        raise ProtocolError(f"stage {through} is not one of {list(order)}")
    end = len(order) - 1 if through is None else order.index(through)  # type: ignore[arg-type,unused-ignore]
    while at < end:
        session.close(order[at])
        at += 1
