"""This member's SecAgg+ stages of one attempt, as sans-I/O steps around the crypto
:class:`~fedsec.crypto.secagg.ClientSession` (which checks every message it takes).

Bodies go through :mod:`fedsec.protocol.codec`.  Each upload asks the aggregator to
hold its answer until the next stage and carry that stage's data (key list, share
relay, unmask request, consistency proof, the round state once the attempt is over):
one request per stage instead of an upload, a long poll of the round state and a fetch.
"""

from __future__ import annotations

import functools
import logging

import msgspec

from fedsec.agent.actions import (
    Advertise,
    FaultPoint,
    FetchKeys,
    FetchProof,
    FetchRoster,
    FetchShares,
    FetchUnmask,
    KeysFetched,
    Mask,
    Masked,
    Passed,
    ProofFetched,
    RosterFetched,
    RouteStages,
    SendConsistency,
    SendShares,
    SharesFetched,
    Step,
    Unmask,
    UnmaskFetched,
    ask,
)
from fedsec.agent.attempt import AttemptOver, StageMissed, upload
from fedsec.agent.charges import TrainedUpdate
from fedsec.agent.charging import charge_step
from fedsec.agent.contribution import Contribution, privacy_report
from fedsec.agent.member_steps import MemberAttempt
from fedsec.crypto.secagg import ClientSession
from fedsec.errors import FedsecError, ProtocolError, WrongStage
from fedsec.protocol import codec
from fedsec.protocol.ddp import is_distributed
from fedsec.protocol.shards import group_index
from fedsec.protocol.stages import Stage
from fedsec.protocol.wire import (
    Accepted,
    ConsistencyProofBody,
    PrivacyReport,
    Receipt,
    ShareRelayBody,
    UnmaskRequestBody,
)

# one logger for every agent event: operators filter on it (logger=fedsec.agent.runtime)
log = logging.getLogger("fedsec.agent.runtime")


class SecAggSteps:
    """The SecAgg+ member steps (:class:`~fedsec.agent.member_steps.MemberSteps`) of
    ``attempt``: its roster and crypto session before anything is spent, the key stages
    while training runs, then masked input, consistency and unmask.

    Under distributed DP the member refuses to unmask a sum of fewer survivors than
    ``dp.min_survivors``, whose noise shares make the full noise.
    """

    first_stage: Stage = "advertise"
    # an aggregator holding the masked input could difference it against a retry's sum
    releases_update = True
    judged_by_rule = False

    def __init__(self, attempt: MemberAttempt) -> None:
        spec = attempt.spec
        self.attempt = attempt
        self.dim = spec.dim  # how the runtime schedules masking
        self.min_survivors = spec.dp.min_survivors if is_distributed(spec) else 0
        self._session: ClientSession | None = None
        self._relay: ShareRelayBody | None = None  # when it came with the shares' answer

    @property
    def session(self) -> ClientSession:
        """The crypto session, opened by :meth:`train` from the verified roster.

        Raises:
            WrongStage: asked for before :meth:`train` opened it.
        """
        if self._session is None:
            raise WrongStage("the SecAgg+ session is opened once the roster is fetched")
        return self._session

    def train(self) -> Step[tuple[TrainedUpdate, bool]]:
        """Open the session, charge, and train while advertising keys and sharing them
        (the privacy report goes with the shares).  If the key stages end the attempt,
        training is still awaited (the update is kept for a retried attempt), then the
        key stages' ending applies.

        Returns:
            The update, and whether the aggregator took the report with the shares.
        """
        attempt = self.attempt
        spec, member = attempt.spec, attempt.member
        # Before training: a roster or parameters that do not check out must not cost
        # any privacy.
        serial = attempt.tracker.state.roster_serial
        roster = yield from ask(FetchRoster(spec.federation_id, serial), RosterFetched)
        if spec.groups:  # a sharded attempt: the verified spec may name our group's server
            url = spec.groups[group_index(spec.groups, member.id)].url
            if url:
                yield from ask(RouteStages(spec.round, spec.attempt, url), Passed)
        self._session = ClientSession(
            spec.member_params(member.id),  # a sharded attempt: its group only
            member.id,
            member.identity,
            roster.keys,
            tolerated_corrupt=member.tolerated_corrupt,
            graph_nonce=attempt.graph_nonce,
        )
        charge = yield from charge_step(spec, attempt.carry, member)
        # the report rides with the shares: one request fewer than POST /report
        report = privacy_report(spec, member, charge)
        yield from attempt.start_training(charge)
        try:
            self._relay, reported = yield from self.key_stages(report)
        except (AttemptOver, StageMissed, FedsecError):
            yield from attempt.await_training()
            raise
        return (yield from attempt.await_training()), reported

    def key_stages(self, report: PrivacyReport) -> Step[tuple[ShareRelayBody | None, bool]]:
        """Advertise and share-keys stages; they do not need the update.  The privacy
        report, charged before training, is sent with the shares.

        Returns:
            The share relay when it came with the shares' answer, and whether the
            shares (and so the report) were taken by this request.
        """
        session, attempt = self.session, self.attempt.tracker
        (r, a), wait = attempt.key, attempt.long_poll_s
        yield from attempt.wait_for(("advertise",))
        body = codec.advertise_body(session.advertise())
        answer = yield from upload(Advertise(r, a, body, wait))
        log.info("secagg_advertised round=%d attempt=%d", r, a)
        yield from ask(FaultPoint(r, "advertise"), Passed)

        if answer is not None and answer.keys is not None:
            keys = answer.keys
        else:
            fetched = yield from attempt.stage_data(
                "share_keys", lambda w: FetchKeys(r, a, w), KeysFetched
            )
            keys = fetched.body
        shares = session.share_keys(codec.key_list(keys))
        answer = yield from upload(SendShares(r, a, codec.share_keys_body(shares, report), wait))
        log.info("secagg_shared round=%d attempt=%d neighbours=%d", r, a, len(shares.shares))
        yield from ask(FaultPoint(r, "share_keys"), Passed)
        if answer is None:  # a 409: an earlier try landed, maybe without this report
            return None, False
        return answer.relay, True

    def finish(self, c: Contribution) -> Step[Receipt]:
        """Masked input, consistency and unmask stages, after the key stages."""
        session, attempt, relay = self.session, self.attempt.tracker, self._relay
        (r, a), wait = attempt.key, attempt.long_poll_s
        if relay is None:
            fetched = yield from attempt.stage_data(
                "masked_input", lambda w: FetchShares(r, a, w), SharesFetched
            )
            relay = fetched.body
        session.receive_shares(codec.share_relay(relay, session.member))
        compute = functools.partial(session.masked_input, c.quantized)
        masked = (yield from ask(Mask(self.dim, compute), Masked)).masked
        # the receipt is held until the unmask stage and comes with our unmask request
        receipt, held = yield from self.attempt.send_vector(c, masked.vector, wait)
        yield from ask(FaultPoint(r, "masked_input"), Passed)

        if held is not None:
            request = held
        else:
            asked = yield from attempt.stage_data(
                "consistency", lambda w: FetchUnmask(r, a, w), UnmaskFetched
            )
            request = asked.body
        if len(request.survivors) < self.min_survivors:
            raise ProtocolError(
                f"only {len(request.survivors)} survivors, fewer than the "
                f"{self.min_survivors} whose noise shares make the round's distributed-DP "
                "noise; refusing to unmask a sum that would carry less noise"
            )
        proof = yield from self._consistency(request)
        answer = session.unmask(codec.consistency_proof(proof, session.member))
        # held until the attempt is over; the answer carries the round state then
        accepted = yield from upload(Unmask(r, a, codec.unmask_body(answer), wait))
        log.info(
            "secagg_unmasked round=%d attempt=%d survivors=%d dropped=%d",
            r,
            a,
            len(request.survivors),
            len(request.dropped),
        )
        self._after_unmask(accepted, request)
        return receipt

    def _consistency(self, request: UnmaskRequestBody) -> Step[ConsistencyProofBody]:
        """Sign the survivor sets we were told, then get our neighbours' signatures on
        the sets they were told: :meth:`ClientSession.unmask` reveals nothing unless
        ``threshold`` of them match ours."""
        session, attempt = self.session, self.attempt.tracker
        (r, a), wait = attempt.key, attempt.long_poll_s
        signature = session.sign_survivors(codec.unmask_request(request))
        answer = yield from upload(SendConsistency(r, a, codec.consistency_body(signature), wait))
        log.info("secagg_signed_survivors round=%d attempt=%d", r, a)
        yield from ask(FaultPoint(r, "consistency"), Passed)
        if answer is not None and answer.proof is not None:
            return answer.proof
        fetched = yield from attempt.stage_data(
            "unmask", lambda w: FetchProof(r, a, w), ProofFetched
        )
        return fetched.body

    def _after_unmask(self, accepted: Accepted | None, request: UnmaskRequestBody) -> None:
        tracker = self.attempt.tracker
        current = tracker.state
        if accepted is not None and accepted.state is not None:
            tracker.state = accepted.state
        elif request.state_token is not None and (current.round, current.attempt) == (tracker.key):
            # the state as of the unmask request: the wait for the close starts there
            tracker.state = msgspec.structs.replace(
                current, stage="unmask", token=request.state_token
            )
