"""Robust aggregation rules in trusted mode (``secure_sum = "none"``): the plain session
keeps the updates and applies the spec's rule at finalize; a refused member gets a logged
``refused`` entry with the reason and a line in the round summary, nothing else changes,
and the audit re-derives the round (FLTrust's: inputs checked, listed as not re-derived)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fedsec.aggregator.coordinator import Coordinator
from fedsec.aggregator.rounds.reference import RootReference
from fedsec.aggregator.workspace import Workspace
from fedsec.audit.verify import verify_log
from fedsec.crypto.quantize import default_ring_bits, dequantize_one, pack, quantize, unpack
from fedsec.crypto.secagg import MaskedInput
from fedsec.errors import AggregationImpossible, ProtocolError
from fedsec.learning import robust
from fedsec.protocol import wire
from fedsec.protocol.log import entry_from_line, lines, make_entry
from fedsec.protocol.log_builder import resign
from fedsec.summation import SessionInputs, open_session
from fedsec.summation.plain import PlainSession
from tests.support.aggregator import (
    FakeClock,
    Federation,
    contribution_statement,
    fixed_delta,
    join_request,
    log_entries,
    make_federation,
    model_params,
    plain_upload,
    quantized_input,
    weight_for,
)

MEMBERS = ("a0", "a1", "a2", "a3", "a4")
KRUM = wire.AggregationSpec(rule="multi_krum", byzantine=1)


def _open_round(fed: Federation, clock: FakeClock, members: tuple[str, ...]) -> Coordinator:
    coord = Coordinator(fed.ws, clock=clock)
    for m in members:
        coord.join(m, 1, 0, join_request(m, 1))
    coord.tick()
    assert coord.live.stage == "masked_input"
    return coord


def _upload(
    fed: Federation, spec: wire.RoundSpec, member: str, delta: np.ndarray
) -> tuple[bytes, str, str]:
    """(raw, commitment, signature) of ``member`` sending ``delta`` (clipped, weighted)."""
    seed = hashlib.sha256(b"rounding/" + member.encode()).digest()
    quantized = quantize(delta, weight_for(member), spec.quant_spec(), seed)
    raw = pack(quantized, spec.ring_bits)
    statement = contribution_statement(member, spec, raw, quantized, fed.identities[member])
    return raw, statement.commitment, statement.signature


def _expected_model(
    old: np.ndarray, spec: wire.RoundSpec, raws: dict[str, bytes], reference: np.ndarray | None
) -> tuple[np.ndarray, robust.RobustAggregate]:
    """Version 1 plus the spec's rule over the uploaded bytes, computed here from scratch."""
    assert spec.aggregation is not None
    rows = [
        dequantize_one(unpack(raws[m], spec.dim + 1, spec.ring_bits), spec.quant_spec())
        for m in sorted(raws)
    ]
    weights = np.array([w for _, w in rows])
    result = robust.aggregate(spec.aggregation, np.stack([u for u, _ in rows]), weights, reference)
    weighted, weight = robust.as_weighted_sum(result, weights)
    return (old + (weighted / weight).astype(np.float32)).astype(np.float32), result


def _summary(fed: Federation) -> wire.RoundSummary:
    row = fed.ws.state.rounds.get(1, 0)
    assert row is not None and row.summary is not None
    return msgspec.json.decode(row.summary, type=wire.RoundSummary)


def test_multi_krum_refuses_the_outlier_with_a_logged_reason_and_changes_nothing_else(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = make_federation(
        tmp_path / "ws",
        agents=MEMBERS,
        round={"secure_sum": "none", "min_agents": 5, "rounds": 1},
        sections={"aggregation": {"rule": "multi_krum", "byzantine": 1}},
    )
    coord = _open_round(fed, clock, MEMBERS)
    spec = coord.live.spec
    assert spec is not None and spec.aggregation == KRUM  # signed into the spec
    ids = fed.identities
    uploads = {m: plain_upload(m, spec, ids) for m in MEMBERS[:4]}
    # a4 pushes the other way, as far as the clip norm lets it
    uploads["a4"] = _upload(fed, spec, "a4", -100 * fixed_delta("a4", spec.dim))
    receipts = {m: coord.masked_input(m, 1, 0, *uploads[m]) for m in MEMBERS[:3]}
    # a restart keeps the updates the rule will judge
    fed.ws.close()
    fed = Federation(Workspace.open(fed.root), fed.identities)
    coord = Coordinator(fed.ws, clock=clock)
    plain = coord.live.plain
    assert plain is not None and sorted(plain.vectors) == ["a0", "a1", "a2"]
    for m in ("a3", "a4"):  # a4's update is accepted (and receipted) like any other
        receipts[m] = coord.masked_input(m, 1, 0, *uploads[m])
    assert all(r.member == m for m, r in receipts.items())

    assert coord.finished
    entries = log_entries(fed.ws)
    (refused,) = [e["body"] for e in entries if e["kind"] == "refused"]
    assert refused["member"] == "a4" and refused["code"] == "refused_by_rule"
    assert refused["sha256"] == hashlib.sha256(uploads["a4"][0]).hexdigest()
    assert refused["detail"].startswith(
        "aggregation rule multi_krum (byzantine=1, krum_selected=0, max_norm_ratio=0.0) "
        "refused a4's update: multi_krum (byzantine=1, selected 4 of 5): its score "
    )
    assert "is not among the 4 lowest" in refused["detail"]
    accepted = [e["body"]["member"] for e in entries if e["kind"] == "accepted"]
    assert sorted(accepted) == list(MEMBERS)
    (aggregate,) = [e["body"] for e in entries if e["kind"] == "aggregate"]
    assert aggregate["survivors"] == ["a0", "a1", "a2", "a3"] and aggregate["dropped"] == ["a4"]
    # the refused entry goes with the close: before the aggregate, under the same head
    kinds = [e["kind"] for e in entries]
    assert kinds.index("refused") < kinds.index("aggregate")

    summary = _summary(fed)
    assert summary.survivors == 4 and summary.dropped == ["a4"]
    assert summary.detail.startswith("aggregation rule multi_krum (byzantine=1")
    assert "a4: multi_krum (byzantine=1, selected 4 of 5): its score" in summary.detail
    # the line a4's agent reads in GET /status: its reason, keyed by its id
    assert list(summary.refused) == ["a4"]
    assert summary.refused["a4"].startswith("multi_krum (byzantine=1, selected 4 of 5): its score")

    # the model is the rule's aggregate of the uploaded bytes...
    raws = {m: u[0] for m, u in uploads.items()}
    old, new = model_params(fed.ws, 1), model_params(fed.ws, 2)
    expected, result = _expected_model(old, spec, raws, None)
    np.testing.assert_array_equal(new, expected)
    assert result.accepted == [0, 1, 2, 3]
    # ...which is the weighted mean of the four others alone: a4 changed nothing
    honest = [quantized_input(m, spec) for m in MEMBERS[:4]]
    rows = [dequantize_one(q, spec.quant_spec()) for q in honest]
    mean = sum(u for u, _ in rows) / sum(w for _, w in rows)
    np.testing.assert_allclose(new, (old + mean).astype(np.float32), rtol=0, atol=1e-6)

    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
    assert (verified.rounds_verified, verified.models_verified) == (1, 1)
    assert verified.underived_rounds == []
    # an operator who re-signs the log to count a4 in is caught by the re-applied rule
    _rewrite_aggregate(fed, survivors=list(MEMBERS), dropped=[])
    tampered = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert not tampered.ok
    assert "the archive gives survivors ['a0', 'a1', 'a2', 'a3']" in str(tampered.problem)


def _rewrite_aggregate(fed: Federation, **body: object) -> None:
    """Change the aggregate entry's body as the operator could: re-chain the log and
    re-sign every later head with the aggregator's key."""
    path = fed.root / "audit" / "log.jsonl"
    logged = [entry_from_line(line) for line in path.read_bytes().splitlines()]
    (index,) = [e.index for e in logged if e.kind == "aggregate"]
    old = logged[index]
    changed = msgspec.structs.replace(old.decode(), **body)
    logged[index] = make_entry(index, old.prev, old.time, changed)
    path.write_bytes(lines(resign(logged, index + 1, fed.ws.signer)))


def test_default_fedavg_keeps_its_spec_and_its_running_sum(
    tmp_path: Path, clock: FakeClock
) -> None:
    fed = make_federation(
        tmp_path / "ws", agents=MEMBERS[:3], round={"secure_sum": "none", "min_agents": 2}
    )
    coord = _open_round(fed, clock, MEMBERS[:3])
    spec = coord.live.spec
    assert spec is not None and spec.aggregation is None
    assert b"aggregation" not in wire.encode(spec)  # specs sign as before rules existed
    coord.masked_input("a0", 1, 0, *plain_upload("a0", spec, fed.identities))
    plain = coord.live.plain
    assert plain is not None and plain.vectors == {}  # O(dim): only the running sum


def test_fltrust_trains_its_reference_and_refuses_the_update_pointing_away(
    tmp_path: Path, clock: FakeClock
) -> None:
    members = MEMBERS[:4]
    fed = make_federation(
        tmp_path / "ws",
        agents=members,
        round={"secure_sum": "none", "min_agents": 3, "rounds": 1},
        sections={"aggregation": {"rule": "fltrust", "root_records": 60}},
    )
    coord = _open_round(fed, clock, members)
    spec = coord.live.spec
    assert spec is not None and spec.aggregation is not None
    reference = RootReference(coord.context)(spec)
    assert 0 < np.linalg.norm(reference) <= spec.clip_norm + 1e-9
    direction = reference / np.linalg.norm(reference)
    rng = np.random.default_rng(7)
    uploads = {
        m: _upload(fed, spec, m, 0.8 * direction + 0.01 * rng.normal(size=spec.dim))
        for m in members[:3]
    }
    uploads["a3"] = _upload(fed, spec, "a3", -direction)  # sign-flipped
    for m in members:
        coord.masked_input(m, 1, 0, *uploads[m])

    assert coord.finished
    entries = log_entries(fed.ws)
    (refused,) = [e["body"] for e in entries if e["kind"] == "refused"]
    assert refused["member"] == "a3" and refused["code"] == "refused_by_rule"
    assert (
        "fltrust: its update does not point the reference's way (cosine -0.9" in (refused["detail"])
    )
    raws = {m: u[0] for m, u in uploads.items()}
    expected, result = _expected_model(model_params(fed.ws, 1), spec, raws, reference)
    np.testing.assert_array_equal(model_params(fed.ws, 2), expected)
    assert all(o.score is not None and o.score > 0.5 for o in result.outcomes[:3])

    audit = fed.root / "audit"
    verified = verify_log(audit / "log.jsonl", audit / "archive", fed.root)
    assert verified.ok, verified.problem
    assert verified.rounds_verified == 0 and verified.models_verified == 0
    (underived,) = verified.underived_rounds
    assert (underived["round"], underived["attempt"], underived["rule"]) == (1, 0, "fltrust")
    assert underived["detail"].startswith(
        "inputs checked (4 archived updates, 3 applied), aggregate and model version not "
        "re-derived: FLTrust weighs each update against a reference the aggregator trains"
    )


# -- the session alone ----------------------------------------------------------------------------


def _spec(aggregation: wire.AggregationSpec | None, secure_sum: str = "none") -> wire.RoundSpec:
    return wire.RoundSpec(
        federation_id="fed-robust",
        round=2,
        attempt=0,
        secure_sum=secure_sum,  # type: ignore[arg-type]
        model_version=1,
        model_sha256="00" * 32,
        task="breast_cancer",
        task_version="1",
        schema_fingerprint="00" * 32,
        cohort=list(MEMBERS),
        neighbors=0,
        threshold=0,
        quant_bits=8,
        ring_bits=default_ring_bits(8, len(MEMBERS)),
        clip_norm=1.0,
        dim=16,
        seed=hashlib.sha256(b"robust-test").hexdigest(),
        max_weight_samples=100,
        weight_caps={},
        training=wire.TrainingSpec(local_epochs=1, batch_size=8, lr=0.1, optimizer="sgd"),
        dp=wire.DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5),
        deadlines={},
        aggregation=aggregation,
    )


def _raw(spec: wire.RoundSpec, member: str, delta: np.ndarray) -> bytes:
    seed = hashlib.sha256(b"rounding/" + member.encode()).digest()
    return pack(quantize(delta, weight_for(member), spec.quant_spec(), seed), spec.ring_bits)


def _deltas(spec: wire.RoundSpec) -> dict[str, bytes]:
    raws = {m: _raw(spec, m, 0.1 + 0.01 * fixed_delta(m, spec.dim)) for m in MEMBERS[:4]}
    raws["a4"] = _raw(spec, "a4", -np.ones(spec.dim))
    return raws


@pytest.mark.parametrize(
    "rule",
    [
        KRUM,
        wire.AggregationSpec(rule="median", max_norm_ratio=1.5),
        wire.AggregationSpec(rule="trimmed_mean", trim_fraction=0.2, max_norm_ratio=1.5),
        wire.AggregationSpec(rule="centered_clipping", max_norm_ratio=1.5),
        wire.AggregationSpec(rule="dnc", byzantine=1),
    ],
)
def test_a_replayed_session_judges_the_same_updates_the_same_way(
    rule: wire.AggregationSpec,
) -> None:
    spec = _spec(rule)
    raws = _deltas(spec)
    first = open_session(spec, SessionInputs({}, 3))
    for m, raw in raws.items():
        first.receive("masked_input", MaskedInput(m, raw))
    result = first.finalize()
    assert result.survivors == ["a0", "a1", "a2", "a3"] and result.dropped == ["a4"]
    (refusal,) = result.refused
    assert refusal.member == "a4" and refusal.sha256 == hashlib.sha256(raws["a4"]).hexdigest()
    assert refusal.detail.startswith(f"aggregation rule {robust.describe(rule)} refused a4's")
    again = open_session(spec, SessionInputs({}, 3))
    for m in reversed(list(raws)):  # stored order does not matter: the rule runs in id order
        again.replay("masked_input", m, raws[m])
    replayed = again.finalize()
    assert replayed.sum_sha256 == result.sum_sha256 and replayed.refused == result.refused
    assert replayed.weight_sum == result.weight_sum


def test_fltrust_with_no_trusted_update_aborts_with_a_clear_error() -> None:
    spec = _spec(wire.AggregationSpec(rule="fltrust"))
    session = open_session(spec, SessionInputs({}, 3, reference=lambda s: -np.ones(s.dim)))
    for m, raw in _deltas(spec).items():
        if m != "a4":
            session.receive("masked_input", MaskedInput(m, raw))
    with pytest.raises(AggregationImpossible, match="fltrust: no update is trusted"):
        session.finalize()


def test_a_rule_needs_trusted_mode_and_fltrust_its_reference() -> None:
    with pytest.raises(ProtocolError, match="no single update is visible"):
        open_session(_spec(KRUM, secure_sum="secagg"), SessionInputs({}, 3))
    with pytest.raises(ProtocolError, match="fltrust needs the aggregator's reference"):
        PlainSession(_spec(wire.AggregationSpec(rule="fltrust")), 3)
