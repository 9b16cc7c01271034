"""The agent runtime: refusals before any privacy is spent, and whole rounds against a
small in-test aggregator (real aiohttp server on loopback, real request verification,
the real SecAgg+ server state machine), so every wire conversion is exercised.

The real aggregator app and its end-to-end test live with fedsec.aggregator.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fedsec.agent import runtime as runtime_mod
from fedsec.agent.ledger import PrivacyLedger
from fedsec.agent.runtime import (
    ADMIN_KEY_FILE,
    AgentRuntime,
    RoundOutcome,
    check_spec_task,
    member_weight,
    verify_round_spec,
)
from fedsec.agent.vault import Vault
from fedsec.config import AgentConfig, AgentSection, DataSection, NetworkSection, PrivacySection
from fedsec.crypto.commitment import CommitmentContext, verify_commitment
from fedsec.crypto.httpsig import NonceCache, RequestVerifier
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import dequantize_one, unpack
from fedsec.crypto.secagg import (
    EncryptedShare,
    MaskedInput,
    ServerSession,
    ShareKeys,
    UnmaskResponse,
)
from fedsec.errors import (
    AuthError,
    BudgetExhausted,
    ClockSkewError,
    ConfigError,
    FedsecError,
    ForbiddenError,
    PayloadError,
    RateLimited,
    ReplayError,
    RequestTimeout,
    ServerBusy,
    SignatureError,
    TaskMismatch,
    WrongStage,
)
from fedsec.keys import load_identity, save_identity, save_public_key
from fedsec.modelfile import encode_model, sha256_hex, sign_manifest
from fedsec.protocol import codec, compact
from fedsec.protocol.roster import sign_roster_entry
from fedsec.protocol.stages import stage_index
from fedsec.protocol.wire import (
    AdvertiseKeysBody,
    ConsistencyBody,
    ContributionStatement,
    DPSpec,
    FederationStatus,
    IncomingShare,
    JoinRequest,
    JoinResponse,
    PrivacyReport,
    Receipt,
    RoundSpec,
    RoundState,
    ShareKeysBody,
    ShareRelayBody,
    UnmaskRequestBody,
    UnmaskResponseBody,
    encode,
)
from fedsec.tasks import get_task
from fedsec.tasks.params import param_count, state_to_arrays
from tests.support.agent import signed_spec

AGGREGATOR = SigningIdentity(bytes(range(32, 64)))
ADMIN = SigningIdentity(bytes(range(96, 128)))
STRANGER = SigningIdentity(bytes(range(64, 96)))
MEMBERS = ("alice", "bob", "carol")
IDENTITIES = {m: SigningIdentity(bytes([i + 1]) * 32) for i, m in enumerate(MEMBERS)}
FED = "fed"
TASK = get_task("breast_cancer")
MODEL = TASK.build_model(0)
DIM = param_count(MODEL)
MODEL_BYTES = encode_model(state_to_arrays(MODEL))
MANIFEST = sign_manifest(
    federation_id=FED,
    version=1,
    parent=None,
    round=None,
    sha256=sha256_hex(MODEL_BYTES),
    metrics={},
    kind="initial",
    signer=AGGREGATOR,
)


def make_spec(cohort: tuple[str, ...] = ("alice",), **changes: Any) -> RoundSpec:
    return signed_spec(
        AGGREGATOR,
        TASK,
        federation_id=FED,
        model_sha256=MANIFEST.sha256,
        dim=DIM,
        cohort=cohort,
        **changes,
    )


def make_config(
    state_dir: Path, url: str, member: str = "alice", epsilon: float = 8.0
) -> AgentConfig:
    return AgentConfig(
        agent=AgentSection(
            id=member,
            aggregator_url=url,
            aggregator_public_key=AGGREGATOR.public_bytes.hex(),
            state_dir=str(state_dir),
            device="cpu",
        ),
        data=DataSection(task="breast_cancer", parts=4, part_index=MEMBERS.index(member), seed=0),
        privacy=PrivacySection(epsilon=epsilon, delta=1e-5),
        network=NetworkSection(
            retry_max=1, backoff_initial_s=0.01, backoff_max_s=0.02, timeout_s=20.0
        ),
    )


# ---------------------------------------------------------------- in-test aggregator


class FakeAggregator:
    """Just enough of the aggregator API to run one round: stages advance as soon as
    every cohort member has done its part."""

    def __init__(self, spec: RoundSpec) -> None:
        self.spec = spec
        self.cohort = tuple(spec.cohort)
        self.state = RoundState(
            federation_id=FED,
            round=spec.round,
            attempt=spec.attempt,
            stage="open",
            token=1,
            model_version=1,
            rounds_completed=0,
            rounds_target=1,
            finished=False,
        )
        self.changed = asyncio.Event()
        self.by_key = {IDENTITIES[m].key_id: m for m in MEMBERS}
        self.verifier = RequestVerifier(
            lambda kid: IDENTITIES[self.by_key[kid]].public_bytes if kid in self.by_key else None,
            NonceCache(600.0),
        )
        self.requests: list[tuple[str, str, str]] = []
        self.joined: dict[str, JoinRequest] = {}
        self.reports: dict[str, PrivacyReport] = {}
        self.reports_with_shares: set[str] = set()  # members whose report came with shares
        self.vectors: dict[str, bytes] = {}
        self.statements: dict[str, ContributionStatement] = {}
        self.unmasked: set[str] = set()
        self.result: Any = None
        self.secagg: ServerSession | None = None
        self.relays: dict[str, Any] = {}
        self.key_list: Any = None
        self.unmask_request: Any = None
        self.proofs: dict[str, Any] = {}
        self.roster_admin = ADMIN
        if spec.secure_sum == "secagg":
            roster = {m: IDENTITIES[m].public_bytes for m in self.cohort}
            self.secagg = ServerSession(spec.secagg_params(), roster)

    def advance(self, **changes: Any) -> None:
        self.state = msgspec.structs.replace(self.state, token=self.state.token + 1, **changes)
        self.changed.set()
        self.changed = asyncio.Event()

    def reached(self, stage: str) -> None:
        """Stage data before its stage: 409, as the real aggregator answers once a
        ``wait`` is over."""
        if stage_index(self.state.stage) < stage_index(stage):
            raise WrongStage(f"round has not reached stage {stage} yet")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        keyid = self.verifier.verify(request.method, request.raw_path, request.headers, body)
        member = self.by_key[keyid]
        self.requests.append((member, request.method, request.path))
        route = (request.method, request.path)
        try:
            return await self.route(route, member, request, body)
        except FedsecError as exc:
            return web.json_response(
                {"error": exc.code, "detail": exc.detail}, status=exc.http_status
            )

    async def route(
        self, route: tuple[str, str], member: str, request: web.Request, body: bytes
    ) -> web.StreamResponse:
        s, r = self.state, self.spec.round
        if route == ("GET", "/v1/round"):
            wait = request.query.get("wait")
            if wait is not None and int(wait) == s.token:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.changed.wait(), float(request.query.get("timeout", "1"))
                    )
            return _json(self.state)
        if route == ("POST", f"/v1/rounds/{r}/join"):
            self.joined[member] = msgspec.json.decode(body, type=JoinRequest)
            if set(self.joined) == set(self.cohort):
                if self.secagg is not None:  # the graph commitments the members joined with
                    commitments = [self.joined[m].graph_commitment for m in self.spec.cohort]
                    unsigned = msgspec.structs.replace(
                        self.spec, graph_commitments=commitments, signature=""
                    )
                    self.spec = unsigned.sign(AGGREGATOR)
                    roster = {m: IDENTITIES[m].public_bytes for m in self.cohort}
                    self.secagg = ServerSession(self.spec.secagg_params(), roster)
                self.advance(stage="advertise", spec=self.spec)
            return _json(JoinResponse(True, "joined"))
        if route == ("GET", "/v1/models/1/manifest"):
            return web.Response(body=MANIFEST.to_json())
        if route == ("GET", "/v1/models/1"):
            return web.Response(body=MODEL_BYTES)
        if route == ("POST", f"/v1/rounds/{r}/report"):
            report = msgspec.json.decode(body, type=PrivacyReport)
            report.verify(IDENTITIES[member].public_bytes)
            self.reports[member] = report
            if self.secagg is None and set(self.reports) == set(self.cohort):
                self.advance(stage="masked_input")
            return web.json_response({})
        if route == ("GET", "/v1/status"):  # trusted mode: the agent reads why it was refused
            return _json(
                FederationStatus(
                    federation_id=FED,
                    round=s.round,
                    attempt=s.attempt,
                    stage=s.stage,
                    model_version=1,
                    rounds_completed=0,
                    rounds_target=0,
                    finished=False,
                    agents_active=len(MEMBERS),
                    history=[],
                    alerts=[],
                )
            )
        if route == ("GET", "/v1/roster"):
            entries = [
                sign_roster_entry(
                    federation_id=FED,
                    agent_id=m,
                    public_key=IDENTITIES[m].public_bytes,
                    role="agent",
                    admin=ADMIN,
                    added_at=1.0,
                ).to_dict()
                for m in MEMBERS
            ]
            return web.json_response(
                {"entries": entries, "admin_public_key": self.roster_admin.public_bytes.hex()}
            )
        if route == ("POST", f"/v1/rounds/{r}/masked-input"):
            assert request.content_type == "application/octet-stream"
            commitment = request.query.get("commitment", "")
            signature = request.query.get("signature", "")
            if not commitment or not signature:
                raise PayloadError("masked input needs the commitment and signature parameters")
            assert int(request.query["attempt"]) == self.spec.attempt
            statement = ContributionStatement(
                federation_id=FED,
                round=r,
                attempt=self.spec.attempt,
                member=member,
                vector_sha256=hashlib.sha256(body).hexdigest(),
                commitment=commitment,
                signature=signature,
            )
            statement.verify(IDENTITIES[member].public_bytes)  # SignatureError: 401
            self.statements[member] = statement
            self.vectors[member] = body
            if self.secagg is not None:
                self.secagg.receive_masked_input(MaskedInput(member, body))
            receipt = Receipt(
                federation_id=FED,
                round=r,
                attempt=self.spec.attempt,
                member=member,
                contribution_sha256=hashlib.sha256(body).hexdigest(),
                log_index=len(self.vectors),
                issued_at=time.time(),
            ).sign(AGGREGATOR)
            if set(self.vectors) == set(self.cohort):
                if self.secagg is None:
                    self.advance(stage="closed")
                else:
                    self.unmask_request = self.secagg.close_masked_input()
                    self.advance(stage="consistency")
            return _json(receipt)
        return await self.secagg_route(route, member, body)

    async def secagg_route(
        self, route: tuple[str, str], member: str, body: bytes
    ) -> web.StreamResponse:
        assert self.secagg is not None, route
        r = self.spec.round
        if route == ("POST", f"/v1/rounds/{r}/advertise"):
            adv = compact.to_body(body, AdvertiseKeysBody, max_bytes=1 << 20, what="upload")
            self.secagg.receive_advertise(codec.advertise_message(member, adv))
            if len(self.secagg.advertised) == len(self.cohort):
                self.key_list = self.secagg.close_advertise()
                self.advance(stage="share_keys")
            # no ?wait support: the agent falls back to polling the round state
            return web.json_response({"accepted": True})
        if route == ("GET", f"/v1/rounds/{r}/keys"):
            self.reached("share_keys")
            return _json(codec.key_list_body(self.key_list.entries))
        if route == ("POST", f"/v1/rounds/{r}/shares"):
            shares = compact.to_body(body, ShareKeysBody, max_bytes=1 << 20, what="upload")
            if shares.report is not None:
                shares.report.verify(IDENTITIES[member].public_bytes)
                self.reports[member] = shares.report
                self.reports_with_shares.add(member)
            self.secagg.receive_share_keys(
                ShareKeys(
                    member,
                    tuple(
                        EncryptedShare(member, s.recipient, bytes.fromhex(s.ciphertext))
                        for s in shares.shares
                    ),
                )
            )
            if len(self.secagg.shared) == len(self.cohort):
                self.relays = self.secagg.close_share_keys()
                self.advance(stage="masked_input")
            return web.json_response({"accepted": True})
        if route == ("GET", f"/v1/rounds/{r}/shares"):
            self.reached("masked_input")
            relay = self.relays[member]
            return _json(
                ShareRelayBody(
                    list(relay.participants),
                    [IncomingShare(s.sender, s.ciphertext.hex()) for s in relay.shares],
                )
            )
        if route == ("GET", f"/v1/rounds/{r}/unmask"):
            self.reached("consistency")
            req = self.unmask_request
            return _json(UnmaskRequestBody(list(req.survivors), list(req.dropped)))
        if route == ("POST", f"/v1/rounds/{r}/consistency"):
            signed = msgspec.json.decode(body, type=ConsistencyBody)
            self.secagg.receive_consistency(codec.consistency_message(member, signed))
            if len(self.secagg.signatures) == len(self.cohort):
                self.proofs = self.secagg.close_consistency()
                self.advance(stage="unmask")
            return web.json_response({"accepted": True})
        if route == ("GET", f"/v1/rounds/{r}/consistency"):
            self.reached("unmask")
            return _json(codec.consistency_proof_body(self.proofs[member], self.state.token))
        if route == ("POST", f"/v1/rounds/{r}/unmask"):
            answer = compact.to_body(body, UnmaskResponseBody, max_bytes=1 << 20, what="upload")
            self.secagg.receive_unmask(
                UnmaskResponse(
                    member,
                    tuple((m, bytes.fromhex(v)) for m, v in sorted(answer.seed_shares.items())),
                    tuple((m, bytes.fromhex(v)) for m, v in sorted(answer.key_shares.items())),
                )
            )
            self.unmasked.add(member)
            if self.unmasked == set(self.cohort):
                self.result = self.secagg.finalize()
                self.advance(stage="closed")
            return web.json_response({"accepted": True})
        raise AssertionError(f"unexpected request {route}")


def check_commitment(fake: FakeAggregator, state_dir: Path, member: str) -> None:
    """The statement the member signed commits to the update and salt in its vault."""
    statement = fake.statements[member]
    kept = Vault(state_dir).load_update(statement.round, statement.attempt)
    context = CommitmentContext(
        FED, statement.round, statement.attempt, member, fake.spec.ring_bits
    )
    verify_commitment(bytes.fromhex(statement.commitment), kept.update, kept.salt, context)


def _json(value: Any) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


def serve(fake: FakeAggregator, scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        fake.changed = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", fake.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            await asyncio.wait_for(scenario(str(server.make_url("/"))), timeout=50)
        finally:
            await server.close()

    asyncio.run(main())


def run_agents(
    fake: FakeAggregator, tmp_path: Path, members: tuple[str, ...], epsilon: float = 8.0
) -> dict[str, list[RoundOutcome]]:
    results: dict[str, list[RoundOutcome]] = {}

    async def scenario(url: str) -> None:
        runtimes = {
            m: AgentRuntime(
                make_config(tmp_path / m, url, m, epsilon), IDENTITIES[m], poll_timeout_s=2.0
            )
            for m in members
        }
        outcomes = await asyncio.gather(*(rt.run(max_rounds=1) for rt in runtimes.values()))
        results.update(zip(members, outcomes, strict=True))

    serve(fake, scenario)
    return results


# ----------------------------------------------------------------------- pure pieces


def test_spec_signed_by_another_key_is_refused_clearly() -> None:
    spec = make_spec()
    verify_round_spec(spec, AGGREGATOR.public_bytes)
    forged = msgspec.structs.replace(spec, dim=spec.dim + 1)
    with pytest.raises(SignatureError, match=r"^round spec signature does not verify: "):
        verify_round_spec(forged, AGGREGATOR.public_bytes)
    with pytest.raises(SignatureError, match="round spec signature does not verify"):
        verify_round_spec(make_spec().sign(STRANGER), AGGREGATOR.public_bytes)


@pytest.mark.parametrize(
    ("changes", "dim", "message"),
    [
        ({"task": "digits"}, DIM, "trains task 'digits' but this agent is set up for"),
        ({"task_version": "7"}, DIM, "requires task 'breast_cancer' version '7'"),
        ({"schema_fingerprint": "ab" * 32}, DIM, "schema fingerprint"),
        ({}, DIM + 3, f"has {DIM} model parameters but the local"),
    ],
)
def test_task_mismatch_names_the_difference(
    changes: dict[str, Any], dim: int, message: str
) -> None:
    check_spec_task(make_spec(), TASK, DIM)
    with pytest.raises(TaskMismatch, match=message):
        check_spec_task(make_spec(**changes), TASK, dim)


def test_weight_is_capped_by_samples_and_roster_cap() -> None:
    spec = make_spec(max_weight_samples=200, weight_caps={"alice": 0.25})
    assert member_weight(100, spec, "bob") == 0.5
    assert member_weight(1000, spec, "bob") == 1.0
    assert member_weight(100, spec, "alice") == 0.25
    assert member_weight(10, spec, "alice") == 0.05


# ------------------------------------------------------------------- refusals in run


def _history(state_dir: Path) -> int:
    ledger = PrivacyLedger(state_dir)
    return sum(len(ledger.history(d)) for d in ledger.datasets())


def test_budget_exhausted_stops_before_training_and_changes_nothing(tmp_path: Path) -> None:
    fake = FakeAggregator(make_spec())
    with pytest.raises(BudgetExhausted, match=r"would spend epsilon .* > budget 0\.05"):
        run_agents(fake, tmp_path, ("alice",), epsilon=0.05)
    assert _history(tmp_path / "alice") == 0
    assert fake.reports == {} and fake.vectors == {}
    assert ("alice", "GET", "/v1/models/1") not in fake.requests  # nothing downloaded


def test_spec_not_signed_by_pinned_aggregator_stops_run(tmp_path: Path) -> None:
    fake = FakeAggregator(make_spec().sign(STRANGER))
    with pytest.raises(SignatureError, match="round spec signature does not verify"):
        run_agents(fake, tmp_path, ("alice",))
    assert _history(tmp_path / "alice") == 0
    assert fake.reports == {}


def test_round_of_another_task_version_stops_run(tmp_path: Path) -> None:
    fake = FakeAggregator(make_spec(task_version="2"))
    with pytest.raises(TaskMismatch, match="version '2'"):
        run_agents(fake, tmp_path, ("alice",))
    assert _history(tmp_path / "alice") == 0


def test_round_without_dp_is_refused(tmp_path: Path) -> None:
    spec = make_spec(dp=DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5))
    with pytest.raises(ConfigError, match="without differential privacy"):
        run_agents(FakeAggregator(spec), tmp_path, ("alice",))
    assert _history(tmp_path / "alice") == 0


def test_changed_roster_admin_key_is_refused(tmp_path: Path) -> None:
    fake = FakeAggregator(make_spec(cohort=MEMBERS, secure_sum="secagg"))
    for m in MEMBERS:
        (tmp_path / m).mkdir()
        save_public_key(tmp_path / m / ADMIN_KEY_FILE, STRANGER.public_bytes)
    with pytest.raises(SignatureError, match="pinned in"):
        run_agents(fake, tmp_path, MEMBERS)
    assert all(_history(tmp_path / m) == 0 for m in MEMBERS)  # refused before training
    assert fake.reports == {}


# ------------------------------------------------------------------------ whole rounds


def test_plain_round_contributes_and_keeps_receipt_record_and_vault(tmp_path: Path) -> None:
    spec = make_spec(max_weight_samples=1000)
    fake = FakeAggregator(spec)
    outcomes = run_agents(fake, tmp_path, ("alice",))["alice"]

    (outcome,) = outcomes
    assert outcome.status == "closed", outcome
    samples = fake.joined["alice"].samples
    assert samples == outcome.samples > 0
    assert fake.joined["alice"].dataset_schema == TASK.schema.fingerprint()
    vector = fake.vectors["alice"]
    q = unpack(vector, DIM + 1, spec.ring_bits)
    _, weight = dequantize_one(q, spec.quant_spec())
    assert weight == pytest.approx(samples / 1000, abs=1 / 255)

    report = fake.reports["alice"]
    ledger = PrivacyLedger(tmp_path / "alice")
    (dataset,) = ledger.datasets()
    assert report.epsilon == pytest.approx(ledger.spent(dataset)) and report.epsilon > 0
    assert len(ledger.history(dataset)) == 1

    vault = Vault(tmp_path / "alice")
    (receipt,) = vault.receipts()
    assert receipt == outcome.receipt
    assert receipt.contribution_sha256 == hashlib.sha256(vector).hexdigest()
    (record,) = vault.records()
    assert (record.round, record.attempt, record.samples) == (1, 1, samples)
    assert record.contribution_sha256 == receipt.contribution_sha256
    assert record.epsilon == pytest.approx(report.epsilon)
    kept = vault.load_update(1, 1)
    assert np.array_equal(kept.update, q) and len(kept.salt) == 32
    statement = fake.statements["alice"]
    assert (statement.round, statement.attempt, statement.member) == (1, 1, "alice")
    assert statement.vector_sha256 == receipt.contribution_sha256
    check_commitment(fake, tmp_path / "alice", "alice")
    for path in (tmp_path / "alice" / "vault").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("inline_masking", [True, False], ids=["inline", "thread"])
def test_secagg_round_with_three_agents_sums_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline_masking: bool
) -> None:
    # small vectors are masked on the event loop, large ones in a worker thread
    monkeypatch.setattr(runtime_mod, "INLINE_MASKING_MAX_DIM", 10**9 if inline_masking else 0)
    spec = make_spec(cohort=MEMBERS, secure_sum="secagg")
    fake = FakeAggregator(spec)
    outcomes = run_agents(fake, tmp_path, MEMBERS)

    assert {m: [o.status for o in outs] for m, outs in outcomes.items()} == {
        m: ["closed"] for m in MEMBERS
    }
    result = fake.result
    assert result is not None and set(result.survivors) == set(MEMBERS)
    expected = sum(Vault(tmp_path / m).load_update(1, 1).update.astype(np.int64) for m in MEMBERS)
    ring_mask = (1 << spec.ring_bits) - 1
    assert np.array_equal(result.ring_sum.astype(np.int64), expected & ring_mask)
    # each privacy report came with the member's shares, none on its own
    assert fake.reports_with_shares == set(MEMBERS) == set(fake.reports)
    assert ("POST", "/v1/rounds/1/report") not in {(verb, path) for _, verb, path in fake.requests}
    for m in MEMBERS:
        report = fake.reports[m]
        ledger = PrivacyLedger(tmp_path / m)
        (dataset,) = ledger.datasets()
        assert (report.round, report.attempt, report.member) == (1, 1, m)
        assert report.epsilon == pytest.approx(ledger.spent(dataset))
        assert report.trained_round == 1 and report.steps == ledger.history(dataset)[0].steps
        assert (tmp_path / m / ADMIN_KEY_FILE).read_text().strip() == ADMIN.public_bytes.hex()
        (receipt,) = Vault(tmp_path / m).receipts()
        assert receipt.contribution_sha256 == hashlib.sha256(fake.vectors[m]).hexdigest()
        check_commitment(fake, tmp_path / m, m)


class AbortingAggregator(FakeAggregator):
    """Aborts attempt 1 after the first privacy report, then runs attempt 2."""

    async def route(
        self, route: tuple[str, str], member: str, request: web.Request, body: bytes
    ) -> web.StreamResponse:
        if route == ("POST", "/v1/rounds/1/report") and self.state.attempt == 1:
            self.reports[member] = msgspec.json.decode(body, type=PrivacyReport)
            self.advance(stage="aborted", detail="too few members")
            self.spec = make_spec(attempt=2)
            self.advance(attempt=2, stage="advertise", spec=self.spec)
            return web.json_response({})
        return await super().route(route, member, request, body)


def test_aborted_attempt_is_dropped_and_the_retry_reuses_the_update(tmp_path: Path) -> None:
    fake = AbortingAggregator(make_spec())
    outcomes = run_agents(fake, tmp_path, ("alice",))["alice"]

    assert [(o.attempt, o.status) for o in outcomes] == [(1, "aborted"), (2, "closed")]
    ledger = PrivacyLedger(tmp_path / "alice")
    (dataset,) = ledger.datasets()
    assert len(ledger.history(dataset)) == 1  # trained and charged once for both attempts
    assert outcomes[0].epsilon == outcomes[1].epsilon == pytest.approx(ledger.spent(dataset))
    (receipt,) = Vault(tmp_path / "alice").receipts()
    assert (receipt.round, receipt.attempt) == (1, 2)
    assert fake.statements["alice"].attempt == 2
    check_commitment(fake, tmp_path / "alice", "alice")  # committed for attempt 2


# --------------------------------------------------------------------------------- CLI


def test_cli_init_writes_key_config_and_prints_public_key(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedsec.agent.cli import agent
    from fedsec.config import load_agent_config
    from fedsec.keys import load_public_key

    home = tmp_path / "alice"
    args = [
        "init",
        "--dir",
        str(home),
        "--agent-id",
        "alice",
        "--aggregator-url",
        "https://agg.example:8443",
        "--aggregator-public-key",
        AGGREGATOR.public_bytes.hex(),
        "--parts",
        "4",
        "--part-index",
        "1",
        "--epsilon",
        "3",
        "--device",
        "cpu",
    ]
    result = CliRunner().invoke(agent, args)
    assert result.exit_code == 0, result.output
    identity = load_identity(home / "identity.key")
    assert stat.S_IMODE((home / "identity.key").stat().st_mode) == 0o600
    assert identity.public_bytes.hex() in result.output
    assert str(home / "identity.pub") in result.output
    assert load_public_key(home / "identity.pub") == identity.public_bytes
    cfg = load_agent_config(home / "agent.toml")
    assert (cfg.agent.id, cfg.data.part_index, cfg.privacy.epsilon) == ("alice", 1, 3.0)
    assert Path(cfg.agent.state_dir) == home.resolve()

    again = CliRunner().invoke(agent, args)
    assert again.exit_code == 1
    assert "already exists" in again.output and "Traceback" not in again.output
    assert load_identity(home / "identity.key").public_bytes == identity.public_bytes

    bad = CliRunner().invoke(agent, [*args[:2], str(tmp_path / "b"), *args[3:6], "ftp://x"])
    assert bad.exit_code != 0
    assert not (tmp_path / "b").exists()


def test_cli_run_unreachable_aggregator_is_one_sentence_and_status_reports(
    tmp_path: Path,
) -> None:
    import socket

    from click.testing import CliRunner

    from fedsec.agent.cli import agent
    from fedsec.config import dump_agent_config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    home = tmp_path / "alice"
    home.mkdir()
    save_identity(IDENTITIES["alice"], home / "identity.key")
    cfg = make_config(Path("."), f"http://127.0.0.1:{port}")
    cfg = msgspec.structs.replace(
        cfg, network=msgspec.structs.replace(cfg.network, retry_max=1, backoff_initial_s=0.01)
    )
    dump_agent_config(cfg, home / "agent.toml")

    result = CliRunner().invoke(agent, ["run", "--config", str(home / "agent.toml")])
    assert result.exit_code == 1
    assert f"aggregator at http://127.0.0.1:{port} unreachable after 2 attempts" in result.output
    assert "Traceback" not in result.output

    status = CliRunner().invoke(agent, ["status", "--config", str(home / "agent.toml")])
    assert status.exit_code == 0, status.output
    assert "epsilon spent 0.000 of 8" in status.output
    assert "receipts: 0" in status.output


def test_agent_back_too_late_for_its_cohort_does_not_train(tmp_path: Path) -> None:
    spec = make_spec(cohort=MEMBERS, secure_sum="secagg")
    fake = FakeAggregator(spec)
    fake.state = msgspec.structs.replace(fake.state, stage="unmask", spec=spec)

    async def finish_soon(url: str) -> None:
        runtime = AgentRuntime(
            make_config(tmp_path / "alice", url), IDENTITIES["alice"], poll_timeout_s=2.0
        )
        task = asyncio.ensure_future(runtime.run())
        while not fake.requests:
            await asyncio.sleep(0.01)
        fake.advance(stage="closed", finished=True)
        outcomes = await task
        assert [(o.status, o.detail) for o in outcomes] == [
            ("missed", "stage advertise already passed (now unmask)")
        ]

    serve(fake, finish_soon)
    assert _history(tmp_path / "alice") == 0
    assert ("alice", "GET", "/v1/models/1") not in fake.requests


# ------------------------------------------------------ refusals the agent outlives


def temporary_refusal(status: int, code: str) -> web.Response:
    return web.json_response(
        {"error": code, "detail": f"{code}, try later"}, status=status, headers={"Retry-After": "0"}
    )


class RefusingAggregator(FakeAggregator):
    """Answers each route in ``refusals`` with its temporary refusals first, then serves it."""

    def __init__(self, spec: RoundSpec, refusals: dict[tuple[str, str], list[tuple[int, str]]]):
        super().__init__(spec)
        self.refusals = {route: list(answers) for route, answers in refusals.items()}
        self.refused: list[tuple[str, str]] = []

    async def route(
        self, route: tuple[str, str], member: str, request: web.Request, body: bytes
    ) -> web.StreamResponse:
        pending = self.refusals.get(route)
        if pending:
            self.refused.append(route)
            return temporary_refusal(*pending.pop(0))
        return await super().route(route, member, request, body)


def test_agent_survives_temporary_refusals_in_the_middle_of_a_round(tmp_path: Path) -> None:
    refusals = {
        ("GET", "/v1/round"): [(408, "request_timeout")],
        ("GET", "/v1/models/1"): [(503, "busy")],
        ("POST", "/v1/rounds/1/report"): [(429, "rate_limited")],
        ("POST", "/v1/rounds/1/masked-input"): [(401, "replayed")],
    }
    fake = RefusingAggregator(make_spec(), refusals)
    (outcome,) = run_agents(fake, tmp_path, ("alice",))["alice"]

    assert outcome.status == "closed", outcome
    assert sorted(fake.refused) == sorted(refusals)
    asked = [(verb, path) for _, verb, path in fake.requests]
    for route in refusals:
        assert asked.count(route) >= 2, route  # refused, then asked again and served
    assert _history(tmp_path / "alice") == 1  # charged once, for the one training
    (receipt,) = Vault(tmp_path / "alice").receipts()
    assert receipt == outcome.receipt


class OutlastingAggregator(FakeAggregator):
    """Refuses the first two round-state polls, and ``refused`` in attempt 1 every time:
    once the agent's two tries are refused it aborts attempt 1 and runs attempt 2."""

    def __init__(self, spec: RoundSpec, refused: tuple[str, str], refusal: tuple[int, str]):
        super().__init__(spec)
        self.refused, self.refusal = refused, refusal
        self.poll_refusals = 2
        self.refusals = 0

    async def route(
        self, route: tuple[str, str], member: str, request: web.Request, body: bytes
    ) -> web.StreamResponse:
        if route == ("GET", "/v1/round") and self.poll_refusals:
            self.poll_refusals -= 1
            return temporary_refusal(503, "busy")
        if route == self.refused and self.state.attempt == 1:
            self.refusals += 1
            if self.refusals == 2:
                self.advance(stage="aborted", detail="too few members")
                self.spec = make_spec(attempt=2)
                self.advance(attempt=2, stage="advertise", spec=self.spec)
            return temporary_refusal(*self.refusal)
        return await super().route(route, member, request, body)


@pytest.mark.parametrize(
    ("refused", "refusal"),
    [
        (("GET", "/v1/models/1"), (503, "busy")),  # charged, not trained yet
        (("POST", "/v1/rounds/1/report"), (429, "rate_limited")),  # trained
    ],
    ids=["model-download", "report"],
)
def test_refusals_past_the_clients_retries_drop_the_attempt_not_the_agent(
    tmp_path: Path, refused: tuple[str, str], refusal: tuple[int, str]
) -> None:
    fake = OutlastingAggregator(make_spec(), refused, refusal)
    outcomes = run_agents(fake, tmp_path, ("alice",))["alice"]

    assert [(o.attempt, o.status) for o in outcomes] == [(1, "dropped"), (2, "closed")]
    assert "still refused" in outcomes[0].detail
    assert fake.poll_refusals == 0 and fake.refusals == 2  # retry_max = 1: two tries each
    # one training, charged once, whether the refusal came before training or after
    assert _history(tmp_path / "alice") == 1
    (receipt,) = Vault(tmp_path / "alice").receipts()
    assert (receipt.round, receipt.attempt) == (1, 2)


@pytest.mark.parametrize(
    ("error", "temporary"),
    [
        (RateLimited("slow down"), True),
        (ServerBusy("full"), True),
        (RequestTimeout("late body"), True),
        (ReplayError("nonce store full"), True),
        (ClockSkewError("still skewed after correcting"), False),
        (AuthError("not on the roster"), False),
        (ForbiddenError("role auditor"), False),
    ],
)
def test_only_temporary_refusals_are_outlived(error: FedsecError, temporary: bool) -> None:
    assert runtime_mod._is_temporary(error) is temporary
    assert runtime_mod._is_round_local(error) is temporary


@contextlib.contextmanager
def server_in_thread(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Iterator[str]:
    """A loopback aiohttp server on an event loop of its own thread, for code that runs
    its own loop (the CLI); yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> TestServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield str(server.make_url("/"))
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.mark.parametrize(
    ("status", "code", "says"),
    [
        (401, "unauthenticated", "is not on the roster or was revoked: ask the consortium admin"),
        (403, "forbidden", "ask the consortium admin to check its roster entry"),
    ],
)
def test_cli_run_ends_on_a_permanent_refusal_with_one_line_and_no_retry(
    tmp_path: Path, status: int, code: str, says: str
) -> None:
    from click.testing import CliRunner

    from fedsec.agent.cli import agent
    from fedsec.config import dump_agent_config

    asked: list[str] = []

    async def refuse(request: web.Request) -> web.Response:
        asked.append(f"{request.method} {request.path}")
        return web.json_response({"error": code, "detail": "the aggregator says no"}, status=status)

    home = tmp_path / "alice"
    home.mkdir()
    save_identity(IDENTITIES["alice"], home / "identity.key")
    with server_in_thread(refuse) as url:
        dump_agent_config(make_config(Path("."), url), home / "agent.toml")
        result = CliRunner().invoke(agent, ["run", "--config", str(home / "agent.toml")])

    assert result.exit_code == 1
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: aggregator refused GET /v1/round as {code}: ")
    assert "the aggregator says no" in line and says in line
    assert "Traceback" not in result.output
    assert asked == ["GET /v1/round"]  # permanent: not retried
