"""The agent runtime: refusals before any privacy is spent, and whole rounds against the
real aggregator app on a loopback port (its coordinator, workspace and transparency log;
:func:`tests.support.agent.live_aggregator`), so every wire conversion and both sides of
every stage are exercised.  Temporary refusals are answered by a middleware in front of
the real app; an aborted attempt is the round engine's own abort, triggered at the
request the test names.

Two cases need a round state an honest aggregator never shows this agent (a spec of
another task version; a cohort that names us at a stage we never reached, as after a
restart): :class:`OddAggregator` serves only that state, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
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
from fedsec.aggregator.coordinator import Coordinator
from fedsec.config import AgentConfig, AgentSection, DataSection, NetworkSection, PrivacySection
from fedsec.crypto.commitment import CommitmentContext, verify_commitment
from fedsec.crypto.identity import SigningIdentity
from fedsec.crypto.quantize import dequantize_one, pack
from fedsec.errors import (
    AuthError,
    BudgetExhausted,
    ClockSkewError,
    ConfigError,
    FedsecError,
    ForbiddenError,
    RateLimited,
    ReplayError,
    RequestTimeout,
    ServerBusy,
    SignatureError,
    TaskMismatch,
)
from fedsec.keys import load_identity, save_identity, save_public_key
from fedsec.modelfile import encode_model, sha256_hex, sign_manifest
from fedsec.protocol.wire import PrivacyReport, RoundSpec, RoundState, encode
from fedsec.tasks import get_task
from fedsec.tasks.params import param_count, state_to_arrays
from tests.support.agent import LiveAggregator, live_aggregator, signed_spec
from tests.support.aggregator import (
    FAST_ROUND,
    Federation,
    expected_params,
    log_entries,
    make_federation,
    model_params,
    table_rows,
)
from tests.support.aggregator import (
    FED as FED_ID,
)

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
    state_dir: Path,
    url: str,
    member: str = "alice",
    epsilon: float = 8.0,
    aggregator_public: bytes = AGGREGATOR.public_bytes,
) -> AgentConfig:
    return AgentConfig(
        agent=AgentSection(
            id=member,
            aggregator_url=url,
            aggregator_public_key=aggregator_public.hex(),
            state_dir=str(state_dir),
            device="cpu",
        ),
        data=DataSection(task="breast_cancer", parts=4, part_index=MEMBERS.index(member), seed=0),
        privacy=PrivacySection(epsilon=epsilon, delta=1e-5),
        network=NetworkSection(
            retry_max=1, backoff_initial_s=0.01, backoff_max_s=0.02, timeout_s=20.0
        ),
    )


# ------------------------------------------------------------------ the real aggregator

#: Deadlines no test run reaches, even on a loaded machine: stages close because every
#: member has done its part, never on time.
LIVE_ROUND = {key: 120.0 for key in FAST_ROUND}


def federation(
    tmp_path: Path,
    members: tuple[str, ...] = ("alice",),
    secure_sum: str = "none",
    dp: dict[str, Any] | None = None,
) -> Federation:
    """A one-round federation of ``members`` (each the whole cohort), not yet served."""
    return make_federation(
        tmp_path / "aggregator",
        members,
        round={
            **LIVE_ROUND,
            "rounds": 1,
            "min_agents": len(members),
            "max_agents": len(members),
            "secure_sum": secure_sum,
            "max_weight_samples": 1000,
        },
        sections={"dp": dp} if dp else None,
    )


@dataclass
class Run:
    """What agents did against the real aggregator: their outcomes, and the server."""

    outcomes: dict[str, list[RoundOutcome]] = field(default_factory=dict)
    live: LiveAggregator | None = None

    @property
    def server(self) -> LiveAggregator:
        assert self.live is not None
        return self.live


def run_agents(
    fed: Federation,
    tmp_path: Path,
    members: tuple[str, ...],
    run: Run | None = None,
    *,
    epsilon: float = 8.0,
    pinned: bytes | None = None,
    setup: Callable[[LiveAggregator], None] | None = None,
) -> Run:
    """Serve ``fed`` and run ``members``' agents until each has one round closed;
    ``pinned``: the aggregator key the agents pin (default: the aggregator's own)."""
    run = run or Run()

    async def main() -> None:
        async with live_aggregator(fed) as live:
            run.live = live
            if setup is not None:
                setup(live)
            key = pinned or fed.ws.signer.public_bytes
            runtimes = [
                AgentRuntime(
                    make_config(tmp_path / m, live.url, m, epsilon, key),
                    fed.identities[m],
                    poll_timeout_s=2.0,
                )
                for m in members
            ]
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(rt.run(max_rounds=1) for rt in runtimes)), 90
            )
            run.outcomes.update(zip(members, outcomes, strict=True))

    asyncio.run(main())
    return run


def accepted_inputs(fed: Federation, member: str) -> list[dict[str, Any]]:
    """The log's entries of ``member``'s accepted contributions (masked inputs,
    ciphertexts, plain vectors: those with a commitment), oldest first."""
    return [
        e["body"]
        for e in log_entries(fed.ws)
        if e["kind"] == "accepted" and e["body"]["member"] == member and "commitment" in e["body"]
    ]


def logged_reports(fed: Federation) -> dict[str, PrivacyReport]:
    """The privacy reports in the log, by member (the last of each)."""
    return {
        e["body"]["member"]: msgspec.convert(e["body"], PrivacyReport)
        for e in log_entries(fed.ws)
        if e["kind"] == "privacy_report"
    }


def round_spec(fed: Federation, round_: int, attempt: int) -> RoundSpec:
    (row,) = [r for r in fed.ws.state.rounds.history() if (r.round, r.attempt) == (round_, attempt)]
    assert row.spec is not None
    return msgspec.json.decode(row.spec, type=RoundSpec)


def check_commitment(fed: Federation, state_dir: Path, member: str) -> None:
    """The statement the member signed last commits to the update and salt in its vault."""
    statement = accepted_inputs(fed, member)[-1]
    r, a = statement["round"], statement["attempt"]
    kept = Vault(state_dir).load_update(r, a)
    context = CommitmentContext(FED_ID, r, a, member, round_spec(fed, r, a).ring_bits)
    verify_commitment(bytes.fromhex(statement["commitment"]), kept.update, kept.salt, context)


def contributions_stored(fed: Federation) -> tuple[list[Any], list[Any]]:
    """The aggregator's rows of privacy reports and of receipts it issued."""
    return table_rows(fed.ws, "reports"), table_rows(fed.ws, "receipts")


def abort_live_attempt(coordinator: Coordinator) -> None:
    """Abort the attempt in progress, as the round engine does when too few members
    are left: the next attempt follows."""
    life = coordinator._lifecycle
    life._abort(coordinator.live, time.time(), "too few members", "round_aborted")


# --------------------------------------------------- a round state no honest aggregator shows


class OddAggregator:
    """Serves ``GET /v1/round`` only, with ``state``: what the real aggregator cannot be
    brought to show (see the module doc).  Any other request is answered 404 and
    recorded, so a test sees that the agent asked for nothing more."""

    def __init__(self, state: RoundState) -> None:
        self.state = state
        self.requests: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def advance(self, **changes: Any) -> None:
        self.state = msgspec.structs.replace(self.state, token=self.state.token + 1, **changes)
        self.changed.set()
        self.changed = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if (request.method, request.path) != ("GET", "/v1/round"):
            return web.json_response({"error": "not_found", "detail": "odd"}, status=404)
        wait = request.query.get("wait")
        if wait is not None and int(wait) == self.state.token:
            with contextlib.suppress(TimeoutError):
                timeout = float(request.query.get("timeout", "1"))
                await asyncio.wait_for(self.changed.wait(), timeout)
        return web.Response(body=encode(self.state), content_type="application/json")


def odd_state(spec: RoundSpec, stage: str) -> RoundState:
    return RoundState(
        federation_id=FED,
        round=spec.round,
        attempt=spec.attempt,
        stage=stage,
        token=1,
        model_version=1,
        rounds_completed=0,
        rounds_target=1,
        finished=False,
        spec=spec,
    )


def serve_odd(odd: OddAggregator, scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", odd.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            await asyncio.wait_for(scenario(str(server.make_url("/"))), timeout=50)
        finally:
            await server.close()

    asyncio.run(main())


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
    fed, run = federation(tmp_path), Run()
    with pytest.raises(BudgetExhausted, match=r"would spend epsilon .* > budget 0\.05"):
        run_agents(fed, tmp_path, ("alice",), run, epsilon=0.05)
    assert _history(tmp_path / "alice") == 0
    assert contributions_stored(fed) == ([], [])
    assert ("GET", "/v1/models/1") not in run.server.requests  # nothing downloaded


def test_spec_not_signed_by_pinned_aggregator_stops_run(tmp_path: Path) -> None:
    fed = federation(tmp_path)
    with pytest.raises(SignatureError, match="round spec signature does not verify"):
        run_agents(fed, tmp_path, ("alice",), pinned=STRANGER.public_bytes)
    assert _history(tmp_path / "alice") == 0
    assert contributions_stored(fed) == ([], [])


def test_round_without_dp_is_refused(tmp_path: Path) -> None:
    fed = federation(tmp_path, dp={"enabled": False})
    with pytest.raises(ConfigError, match="without differential privacy"):
        run_agents(fed, tmp_path, ("alice",))
    assert _history(tmp_path / "alice") == 0
    assert contributions_stored(fed) == ([], [])


def test_changed_roster_admin_key_is_refused(tmp_path: Path) -> None:
    fed = federation(tmp_path, MEMBERS, "secagg")
    for m in MEMBERS:
        (tmp_path / m).mkdir()
        save_public_key(tmp_path / m / ADMIN_KEY_FILE, STRANGER.public_bytes)
    with pytest.raises(SignatureError, match="pinned in"):
        run_agents(fed, tmp_path, MEMBERS)
    assert all(_history(tmp_path / m) == 0 for m in MEMBERS)  # refused before training
    assert contributions_stored(fed) == ([], [])


# ------------------------------------------------------------------------ whole rounds


def test_plain_round_contributes_and_keeps_receipt_record_and_vault(tmp_path: Path) -> None:
    fed = federation(tmp_path)
    old = model_params(fed.ws, 1)
    (outcome,) = run_agents(fed, tmp_path, ("alice",)).outcomes["alice"]

    assert outcome.status == "closed", outcome
    spec = round_spec(fed, 1, 0)
    vault = Vault(tmp_path / "alice")
    kept = vault.load_update(1, 0)
    assert len(kept.salt) == 32
    _, weight = dequantize_one(kept.update, spec.quant_spec())
    assert outcome.samples > 0
    assert weight == pytest.approx(outcome.samples / 1000, abs=1 / 255)
    # the aggregator's new model is FedAvg of exactly the update the vault kept
    assert np.allclose(model_params(fed.ws, 2), expected_params(old, [kept.update], spec))

    report = logged_reports(fed)["alice"]
    ledger = PrivacyLedger(tmp_path / "alice")
    (dataset,) = ledger.datasets()
    assert report.epsilon == pytest.approx(ledger.spent(dataset)) and report.epsilon > 0
    assert len(ledger.history(dataset)) == 1

    (receipt,) = vault.receipts()
    assert receipt == outcome.receipt
    vector = pack(kept.update, spec.ring_bits)  # what a plain round sends
    assert receipt.contribution_sha256 == hashlib.sha256(vector).hexdigest()
    (record,) = vault.records()
    assert (record.round, record.attempt, record.samples) == (1, 0, outcome.samples)
    assert record.contribution_sha256 == receipt.contribution_sha256
    assert record.epsilon == pytest.approx(report.epsilon)
    (statement,) = accepted_inputs(fed, "alice")
    assert (statement["round"], statement["attempt"], statement["member"]) == (1, 0, "alice")
    assert statement["sha256"] == receipt.contribution_sha256
    check_commitment(fed, tmp_path / "alice", "alice")
    for path in (tmp_path / "alice" / "vault").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("inline_masking", [True, False], ids=["inline", "thread"])
def test_secagg_round_with_three_agents_sums_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline_masking: bool
) -> None:
    # small vectors are masked on the event loop, large ones in a worker thread
    monkeypatch.setattr(runtime_mod, "INLINE_MASKING_MAX_DIM", 10**9 if inline_masking else 0)
    fed = federation(tmp_path, MEMBERS, "secagg")
    old = model_params(fed.ws, 1)
    run = run_agents(fed, tmp_path, MEMBERS)

    assert {m: [o.status for o in outs] for m, outs in run.outcomes.items()} == {
        m: ["closed"] for m in MEMBERS
    }
    spec = round_spec(fed, 1, 0)
    kept = [Vault(tmp_path / m).load_update(1, 0).update for m in MEMBERS]
    # the unmasked sum is exactly the sum of the updates the members kept
    assert np.allclose(model_params(fed.ws, 2), expected_params(old, kept, spec))
    # each privacy report came with the member's shares, none on its own
    reports = logged_reports(fed)
    assert set(reports) == set(MEMBERS)
    assert ("POST", "/v1/rounds/1/report") not in run.server.requests
    for m in MEMBERS:
        report = reports[m]
        ledger = PrivacyLedger(tmp_path / m)
        (dataset,) = ledger.datasets()
        assert (report.round, report.attempt, report.member) == (1, 0, m)
        assert report.epsilon == pytest.approx(ledger.spent(dataset))
        assert report.trained_round == 1 and report.steps == ledger.history(dataset)[0].steps
        admin = fed.ws.admin().public_bytes.hex()
        assert (tmp_path / m / ADMIN_KEY_FILE).read_text().strip() == admin
        (receipt,) = Vault(tmp_path / m).receipts()
        assert receipt.contribution_sha256 == accepted_inputs(fed, m)[-1]["sha256"]
        check_commitment(fed, tmp_path / m, m)


def test_aborted_attempt_is_dropped_and_the_retry_reuses_the_update(tmp_path: Path) -> None:
    fed = federation(tmp_path)

    def abort_after_the_first_report(live: LiveAggregator) -> None:
        def abort() -> None:
            if live.coordinator.live.attempt == 0:
                abort_live_attempt(live.coordinator)

        live.after[("POST", "/v1/rounds/1/report")] = abort

    outcomes = run_agents(fed, tmp_path, ("alice",), setup=abort_after_the_first_report)
    alice = outcomes.outcomes["alice"]

    # the real engine's plain round is at masked_input already: the agent learns of the
    # abort from the refusal of its upload (a poll that sees it first: "aborted")
    assert [(o.attempt, o.status) for o in alice] == [(0, "dropped"), (1, "closed")]
    assert "attempt 0, but the current round is 1 attempt 1" in alice[0].detail
    ledger = PrivacyLedger(tmp_path / "alice")
    (dataset,) = ledger.datasets()
    assert len(ledger.history(dataset)) == 1  # trained and charged once for both attempts
    assert alice[0].epsilon == alice[1].epsilon == pytest.approx(ledger.spent(dataset))
    (receipt,) = Vault(tmp_path / "alice").receipts()
    assert (receipt.round, receipt.attempt) == (1, 1)
    assert [s["attempt"] for s in accepted_inputs(fed, "alice")] == [1]
    check_commitment(fed, tmp_path / "alice", "alice")  # committed for attempt 1


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
    odd = OddAggregator(odd_state(make_spec(cohort=MEMBERS, secure_sum="secagg"), "unmask"))

    async def finish_soon(url: str) -> None:
        runtime = AgentRuntime(
            make_config(tmp_path / "alice", url), IDENTITIES["alice"], poll_timeout_s=2.0
        )
        task = asyncio.ensure_future(runtime.run())
        while not odd.requests:
            await asyncio.sleep(0.01)
        odd.advance(stage="closed", finished=True)
        outcomes = await task
        assert [(o.status, o.detail) for o in outcomes] == [
            ("missed", "stage advertise already passed (now unmask)")
        ]

    serve_odd(odd, finish_soon)
    assert _history(tmp_path / "alice") == 0
    # nothing downloaded, nothing sent (it looked for audit challenges, as agents do)
    assert set(odd.requests) <= {("GET", "/v1/round"), ("GET", "/v1/audit/challenges")}


def test_round_of_another_task_version_stops_run(tmp_path: Path) -> None:
    odd = OddAggregator(odd_state(make_spec(task_version="2"), "advertise"))

    async def run(url: str) -> None:
        runtime = AgentRuntime(
            make_config(tmp_path / "alice", url), IDENTITIES["alice"], poll_timeout_s=2.0
        )
        with pytest.raises(TaskMismatch, match="version '2'"):
            await runtime.run()

    serve_odd(odd, run)
    assert _history(tmp_path / "alice") == 0
    assert set(odd.requests) == {("GET", "/v1/round")}


# ------------------------------------------------------ refusals the agent outlives


def test_agent_survives_temporary_refusals_in_the_middle_of_a_round(tmp_path: Path) -> None:
    refusals = {
        ("GET", "/v1/round"): [(408, "request_timeout")],
        ("GET", "/v1/models/1"): [(503, "busy")],
        ("POST", "/v1/rounds/1/report"): [(429, "rate_limited")],
        ("POST", "/v1/rounds/1/masked-input"): [(401, "replayed")],
    }

    def refuse(live: LiveAggregator) -> None:
        live.refusals.update({route: list(answers) for route, answers in refusals.items()})

    run = run_agents(federation(tmp_path), tmp_path, ("alice",), setup=refuse)
    (outcome,) = run.outcomes["alice"]

    assert outcome.status == "closed", outcome
    assert sorted(run.server.refused) == sorted(refusals)
    for route in refusals:
        assert run.server.requests.count(route) >= 2, route  # refused, then served
    assert _history(tmp_path / "alice") == 1  # charged once, for the one training
    (receipt,) = Vault(tmp_path / "alice").receipts()
    assert receipt == outcome.receipt


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
    """The first two round-state polls are refused, and ``refused`` in attempt 0 every
    time: once the agent's two tries are refused, attempt 0 is aborted."""
    tries: list[tuple[str, str]] = []

    def refuse(live: LiveAggregator) -> None:
        live.refusals[("GET", "/v1/round")] = [(503, "busy"), (503, "busy")]

        def outlast(route: tuple[str, str]) -> tuple[int, str] | None:
            if route != refused or live.coordinator.live.attempt != 0:
                return None
            tries.append(route)
            if len(tries) == 2:
                abort_live_attempt(live.coordinator)
            return refusal

        live.refuse_when = outlast

    run = run_agents(federation(tmp_path), tmp_path, ("alice",), setup=refuse)
    outcomes = run.outcomes["alice"]

    assert [(o.attempt, o.status) for o in outcomes] == [(0, "dropped"), (1, "closed")]
    assert "still refused" in outcomes[0].detail
    assert run.server.refusals[("GET", "/v1/round")] == []  # both poll refusals given
    assert len(tries) == 2  # retry_max = 1: two tries each
    # one training, charged once, whether the refusal came before training or after
    assert _history(tmp_path / "alice") == 1
    (receipt,) = Vault(tmp_path / "alice").receipts()
    assert (receipt.round, receipt.attempt) == (1, 1)


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
