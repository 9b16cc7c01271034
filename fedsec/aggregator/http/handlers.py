"""The endpoint handlers: each authenticates, decodes, calls the coordinator (or the
challenge desk, or the model store) and encodes the answer.

Handlers only move bytes; the protocol's rules are the coordinator's.  Which handler
serves which route, and so its roles and body limit, is the table in
:mod:`fedsec.aggregator.http.app`.
"""

from __future__ import annotations

import weakref
from typing import Final, Generic, TypeVar

import msgspec
from aiohttp import web

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.http.auth import authenticate
from fedsec.aggregator.http.errors import json_response
from fedsec.aggregator.http.keys import CHALLENGES, COORDINATOR, WORKSPACE
from fedsec.aggregator.http.longpoll import CHANGED, hold_until, hold_while, next_stage_data
from fedsec.aggregator.http.params import (
    decode_json,
    decode_upload,
    model_version,
    round_args,
    seconds,
    statement_params,
    wait_seconds,
)
from fedsec.aggregator.openapi import openapi_document
from fedsec.aggregator.storage.leadership import local_role
from fedsec.aggregator.storage.roster_file import Roster
from fedsec.aggregator.workspace import Workspace
from fedsec.protocol import wire
from fedsec.protocol.limits import MAX_COUNT

# -- public endpoints --------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    # replicas: load balancers route to the leader by its role; token for the operator
    role = local_role(request.app[WORKSPACE].state)
    answer: dict[str, object] = {"status": "ok", "role": role.role}
    if role.token is not None:
        answer["token"] = role.token
    return json_response(answer)


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


async def status(request: web.Request) -> web.Response:
    # alerts and round history are the consortium's, not the public's: any enrolled role
    caller, _ = await authenticate(request)
    coord = request.app[COORDINATOR]
    ws = request.app[WORKSPACE]
    now = coord.round_state()
    entry = ws.roster.get(caller)
    sees_all = entry is not None and entry.role in REFUSAL_READERS
    history = [
        summary if sees_all else own_refusal_only(summary, caller)
        for summary in (
            msgspec.json.decode(r.summary, type=wire.RoundSummary)
            for r in ws.state.rounds.history(200)
            if r.summary is not None
        )
    ]
    return json_response(
        wire.FederationStatus(
            federation_id=ws.federation_id,
            round=now.round,
            attempt=now.attempt,
            stage=now.stage,
            model_version=now.model_version,
            rounds_completed=now.rounds_completed,
            rounds_target=now.rounds_target,
            finished=now.finished,
            agents_active=len(ws.roster.active_agents()),
            history=history,
            alerts=coord.alerts[-50:],
        )
    )


#: Roles that read why the aggregation rule refused each member (its norm, its cosine
#: with the reference): the operator's observers, and the checkers, who read the same
#: sentences in the transparency log's refused entries anyway.  A member reads its own.
REFUSAL_READERS: Final[frozenset[str]] = frozenset({"observer", "auditor", "custodian"})


def own_refusal_only(summary: wire.RoundSummary, member: str) -> wire.RoundSummary:
    """``summary`` as ``member`` may read it: of the aggregation rule's refusals, only its
    own reason; of the others, their count (who was dropped stays in ``dropped``)."""
    if not summary.refused:
        return summary
    own = {member: summary.refused[member]} if member in summary.refused else {}
    others = len(summary.refused) - len(own)
    detail = f"the aggregation rule kept {len(summary.refused)} accepted updates out"
    if own:
        detail += f", yours among them ({others} others): {own[member]}"
    return msgspec.structs.replace(summary, refused=own, detail=detail)


# -- agent endpoints ---------------------------------------------------------------------------


async def get_round(request: web.Request) -> web.Response:
    await authenticate(request)
    coord = request.app[COORDINATOR]
    wait = wire.parse_uint(request.query.get("wait", "0"), "wait token", MAX_COUNT)
    timeout = seconds(request.query.get("timeout", "0"), "timeout")
    if wait and wait == coord.token and timeout > 0:
        await request.app[CHANGED].wait(timeout)
    return json_response(_round_state(coord))


def _round_state(coord: Coordinator) -> wire.RoundState:
    """The round state to answer with, its spec's JSON spliced in as encoded once per
    spec: the spec lists the cohort and its graph commitments (~80 bytes a member), and
    every member reads the state after each change, so encoding it per answer was O(n)
    each, O(n^2) a round."""
    state = coord.round_state()
    if state.spec is None:
        return state
    return msgspec.structs.replace(state, spec=_SPEC_JSON.of(state.spec))


async def get_roster(request: web.Request) -> web.Response:
    await authenticate(request)
    body = _roster_body(request.app[WORKSPACE])
    return web.Response(body=body, content_type="application/json")


# GET /roster's body as encoded at a roster serial.  Every member fetches the roster when
# its serial moves, so 1,000 members had the aggregator encode a 1,000-entry roster 1,000
# times (14 ms each, profiled: 15 % of its CPU in a round); now once per change.
_ROSTER_BODIES: weakref.WeakKeyDictionary[Roster, tuple[int, bytes]] = weakref.WeakKeyDictionary()


def _roster_body(ws: Workspace) -> bytes:
    roster = ws.roster
    serial = roster.serial
    cached = _ROSTER_BODIES.get(roster)
    if cached is not None and cached[0] == serial:
        return cached[1]
    body = wire.encode(
        {
            "federation_id": ws.federation_id,
            "admin_public_key": ws.admin_public.hex(),
            "entries": [e.to_dict() for e in roster.entries()],
        }
    )
    _ROSTER_BODIES[roster] = (serial, body)
    return body


async def join(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    req = decode_json(body, wire.JoinRequest, request, "join request")
    return json_response(request.app[COORDINATOR].join(member, r, a, req))


async def report(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    rep = decode_json(body, wire.PrivacyReport, request, "privacy report")
    request.app[COORDINATOR].report(member, r, a, rep)
    return json_response({"accepted": True})


async def evaluation(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    rep = decode_json(body, wire.EvaluationReport, request, "evaluation report")
    request.app[COORDINATOR].evaluation(member, r, a, rep)
    return json_response({"accepted": True})


async def advertise(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    msg = decode_upload(body, wire.AdvertiseKeysBody, request, "key advertisement")
    wait = wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.advertise(member, r, a, msg)
    del body, msg  # accepted: not held through the wait (see masked_input)
    keys = await next_stage_data(
        request, r, a, "share_keys", wait, lambda: coord.key_list(member, r, a)
    )
    # the key list's JSON spliced in as it is: msgspec writes a Raw value verbatim
    spliced = None if keys is None else _KEY_LIST_JSON.of(keys)
    return json_response(wire.Accepted(accepted=True, keys=spliced))  # type: ignore[arg-type]


async def keys(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, a = round_args(request)
    await hold_until(request, r, a, "share_keys", wait_seconds(request))
    body = _KEY_LIST_JSON.encoded(request.app[COORDINATOR].key_list(member, r, a))
    return web.Response(body=body, content_type="application/json")


_Shared = TypeVar("_Shared")


class _EncodedOnce(Generic[_Shared]):
    """The JSON of the last value of one kind served, for a value every member is sent
    as it is and that lists the cohort: encoding it per member was O(n) each, O(n^2) a
    round (the key list: 164 µs a member at 1,000); it is encoded once per object.  A
    session hands out one object until the value changes (the key list, the unmask
    request per state token, the spec per attempt), and the object is held until the
    next one, so an identical object is the same value."""

    def __init__(self) -> None:
        self._last: tuple[_Shared, bytes] | None = None

    def encoded(self, value: _Shared) -> bytes:
        """``wire.encode(value)``, encoded once for each object."""
        if self._last is None or self._last[0] is not value:
            self._last = (value, wire.encode(value))
        return self._last[1]

    def of(self, value: _Shared) -> msgspec.Raw:
        """The same JSON as a value to put in another struct (msgspec copies nothing)."""
        return msgspec.Raw(self.encoded(value))


# a SecAgg+ session hands every live member the same key list (every advertisement:
# members derive the graph from all of them), ~380 bytes a member
_KEY_LIST_JSON: Final = _EncodedOnce[wire.KeyListBody]()
# every survivor's unmask request: the survivor and dropped sets (SecAggPlusSession)
_UNMASK_JSON: Final = _EncodedOnce[wire.UnmaskRequestBody]()
_SPEC_JSON: Final = _EncodedOnce[wire.RoundSpec]()
# every survivor's consistency proof: the survivor and dropped sets, the same list
# objects in each proof (SecAggPlusSession); only the neighbours' signatures differ
_SURVIVORS_JSON: Final = _EncodedOnce[list[str]]()
_DROPPED_JSON: Final = _EncodedOnce[list[str]]()


def _spliced_proof(proof: wire.ConsistencyProofBody) -> wire.ConsistencyProofBody:
    """``proof`` with its survivor sets' JSON spliced in as encoded once per list."""
    return msgspec.structs.replace(
        proof,
        survivors=_SURVIVORS_JSON.of(proof.survivors),
        dropped=_DROPPED_JSON.of(proof.dropped),
    )


async def post_shares(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    msg = decode_upload(body, wire.ShareKeysBody, request, "encrypted shares")
    wait = wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.share_keys(member, r, a, msg)
    del body, msg  # accepted: not held through the wait (see masked_input)
    relay = await next_stage_data(
        request, r, a, "masked_input", wait, lambda: coord.share_relay(member, r, a)
    )
    return json_response(wire.Accepted(accepted=True, relay=relay))


async def get_shares(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, a = round_args(request)
    await hold_until(request, r, a, "masked_input", wait_seconds(request))
    return json_response(request.app[COORDINATOR].share_relay(member, r, a))


async def post_commit(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    msg = decode_json(body, wire.CommitBody, request, "ciphertext commitment")
    wait = wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.commit(member, r, a, msg)
    del body, msg  # accepted: not held through the wait (see masked_input)
    commitments = await next_stage_data(
        request, r, a, "masked_input", wait, lambda: coord.commitment_set(member, r, a)
    )
    return json_response(wire.Accepted(accepted=True, commitments=commitments))


async def get_commit(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, a = round_args(request)
    await hold_until(request, r, a, "masked_input", wait_seconds(request))
    return json_response(request.app[COORDINATOR].commitment_set(member, r, a))


async def masked_input(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    commitment, signature = statement_params(request)
    wait = wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    receipt = coord.masked_input(member, r, a, body, commitment, signature)
    # summed and stored: a held answer waits for the stage to close (most of it, with
    # 1,000 members) and must not keep a model-sized upload per member meanwhile
    del body
    if "wait" not in request.query:
        return json_response(receipt)
    # the mode says what the answer waits for: SecAgg+ the unmask request, from stage
    # consistency; the others nothing (another attempt is never held)
    after = coord.held_answer_stage("masked_input")
    held = wait if after is not None else 0.0
    unmask = await next_stage_data(
        request, r, a, after or "consistency", held, lambda: coord.unmask_request(member, r, a)
    )
    spliced = None if unmask is None else _UNMASK_JSON.of(unmask)
    return json_response(wire.MaskedInputAnswer(receipt=receipt, unmask=spliced))  # type: ignore[arg-type]


async def get_unmask(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, a = round_args(request)
    await hold_until(request, r, a, "consistency", wait_seconds(request))
    body = _UNMASK_JSON.encoded(request.app[COORDINATOR].unmask_request(member, r, a))
    return web.Response(body=body, content_type="application/json")


async def post_consistency(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    msg = decode_json(body, wire.ConsistencyBody, request, "consistency signature")
    wait = wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.consistency(member, r, a, msg)
    del body, msg  # accepted: not held through the wait (see masked_input)
    proof = await next_stage_data(
        request, r, a, "unmask", wait, lambda: coord.consistency_proof(member, r, a)
    )
    spliced = None if proof is None else _spliced_proof(proof)
    return json_response(wire.Accepted(accepted=True, proof=spliced))


async def get_consistency(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, a = round_args(request)
    await hold_until(request, r, a, "unmask", wait_seconds(request))
    return json_response(_spliced_proof(request.app[COORDINATOR].consistency_proof(member, r, a)))


async def post_unmask(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    msg = decode_upload(body, wire.UnmaskResponseBody, request, "unmask answer")
    wait = wait_seconds(request)  # checked before anything is accepted
    coord = request.app[COORDINATOR]
    coord.unmask(member, r, a, msg)
    del body, msg  # accepted: not held through the wait (see masked_input)
    if wait <= 0:
        return json_response(wire.Accepted(accepted=True))

    def unmasking() -> bool:
        return coord.in_stage(r, a, "unmask")

    # held until the attempt is over: the answer then carries the state the agent
    # would otherwise long-poll for next (closed, usually the next round already open)
    await hold_while(request, unmasking, wait)
    return json_response(
        wire.Accepted(accepted=True, state=None if unmasking() else _round_state(coord))
    )


async def receipt(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, _a = round_args(request)
    return json_response(request.app[COORDINATOR].receipt(member, r))


# -- audit challenges and reveals ----------------------------------------------------------------


async def post_challenge(request: web.Request) -> web.Response:
    auditor, body = await authenticate(request)
    req = decode_json(body, wire.ChallengeRequest, request, "challenge")
    return json_response(request.app[CHALLENGES].challenge(auditor, req))


async def post_quarantine(request: web.Request) -> web.Response:
    auditor, body = await authenticate(request)
    order = decode_json(body, wire.QuarantineOrder, request, "quarantine order")
    return json_response(request.app[COORDINATOR].quarantine(auditor, order))


async def get_challenges(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    return json_response(request.app[CHALLENGES].open_for(member))


async def post_reveal(request: web.Request) -> web.Response:
    ws = request.app[WORKSPACE]
    member, body = await authenticate(request)
    reveal = wire.decode(
        body, wire.RevealBody, max_bytes=ws.config.server.max_body_bytes, what="reveal"
    )
    return json_response(request.app[CHALLENGES].reveal(member, reveal))


async def get_reveals(request: web.Request) -> web.Response:
    auditor, _ = await authenticate(request)
    return json_response(request.app[CHALLENGES].reveals_for(auditor))


# -- homomorphic summation: the key custodian -------------------------------------------------


async def put_he_context(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    published = decode_json(body, wire.HeContext, request, "public CKKS context")
    request.app[COORDINATOR].publish_he_context(member, published)
    return json_response({"accepted": True})


async def get_he_context(request: web.Request) -> web.Response:
    await authenticate(request)
    return json_response(request.app[COORDINATOR].he_context())


async def get_he_sum(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    r, a = round_args(request)
    await hold_until(request, r, a, "decrypt", wait_seconds(request))
    return json_response(request.app[COORDINATOR].he_sum(member, r, a))


async def post_decryption(request: web.Request) -> web.Response:
    member, body = await authenticate(request)
    r, a = round_args(request)
    request.app[COORDINATOR].decryption(member, r, a, body)
    return json_response({"accepted": True})


# -- the transparency log and its archive (auditors, the key custodian) -----------------------


async def get_log(request: web.Request) -> web.Response:
    await authenticate(request)
    start = wire.parse_uint(request.query.get("from", "0"), "log index", MAX_COUNT)
    return web.Response(
        body=request.app[COORDINATOR].log_lines(start), content_type="application/x-ndjson"
    )


async def get_archive(request: web.Request) -> web.Response:
    member, _ = await authenticate(request)
    data = request.app[COORDINATOR].archived(member, request.match_info["sha256"])
    return web.Response(body=data, content_type="application/octet-stream")


async def latest_manifest(request: web.Request) -> web.Response:
    await authenticate(request)
    return web.Response(
        body=request.app[WORKSPACE].models.latest().to_json(), content_type="application/json"
    )


async def manifest(request: web.Request) -> web.Response:
    await authenticate(request)
    m = request.app[WORKSPACE].models.get(model_version(request))
    return web.Response(body=m.to_json(), content_type="application/json")


async def model(request: web.Request) -> web.Response:
    await authenticate(request)
    data = request.app[WORKSPACE].models.read(model_version(request))
    return web.Response(body=data, content_type="application/octet-stream")
