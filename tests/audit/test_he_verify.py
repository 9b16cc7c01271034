"""``fedsec audit verify`` on a homomorphic-summation round, honest and tampered.

The records are built without the aggregator's HE code (written separately): a real
aggregator workspace (keys, model store, state database) writes the log through its own
:class:`~fedsec.aggregator.storage.audit_trail.AuditTrail`, and this module appends what an
HE round logs (docs/audit-log.md §3, §7): the custodian's ``he_context`` statement with the
public context archived by its SHA-256, the signed spec, each member's ``accepted``
ciphertext (``frame_chunks`` of ``he.encrypt`` of its quantized vector) with its contribution
statement, the custodian's ``he_decryption`` statement with the plaintext (the decrypted,
rounded integer sum as ``<i8``) archived by its SHA-256, the ``aggregate`` entry, the new
model version and a head.  The custodian's decryption is real (``decrypt_sum`` with the
secret context), so the honest case also shows the plaintext is the exact integer sum.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from click.testing import CliRunner

he = pytest.importorskip("fedsec.crypto.he", reason="homomorphic summation needs TenSEAL")

from fedsec.aggregator.storage.audit_trail import ARCHIVE_DIR, LOG_FILE, AuditTrail  # noqa: E402
from fedsec.aggregator.workspace import Workspace, init_workspace  # noqa: E402
from fedsec.audit.report import build_report  # noqa: E402
from fedsec.audit.verify import VerifyResult, verify_log  # noqa: E402
from fedsec.cli import main  # noqa: E402
from fedsec.config import default_federation_toml  # noqa: E402
from fedsec.crypto.identity import SigningIdentity  # noqa: E402
from fedsec.crypto.quantize import default_ring_bits, dequantize_sum, quantize  # noqa: E402
from fedsec.learning.optimizers import FedAvg, server_step  # noqa: E402
from fedsec.modelfile import decode_model  # noqa: E402
from fedsec.protocol import wire  # noqa: E402
from fedsec.protocol.limits import MAX_MODEL_BYTES  # noqa: E402
from fedsec.protocol.log_entries import (  # noqa: E402
    AcceptedEntry,
    AggregateEntry,
    GenesisEntry,
    RoundOpenEntry,
)
from fedsec.protocol.roster import Role, sign_roster_entry  # noqa: E402
from fedsec.tasks import get_task  # noqa: E402
from fedsec.tasks.params import (  # noqa: E402
    arrays_to_state,
    flatten_params,
    load_flat_params,
    state_to_arrays,
)

FID = "fed-he"
CUSTODIAN = "custodian-1"
AGENTS = ("agent-1", "agent-2", "agent-3", "agent-4")
ATTEMPT = 0
PARAMS = he.HeParams(4096, (60, 49), 40)  # one ciphertext holds the 1059 values
IntVector = npt.NDArray[np.int64]


@pytest.fixture(scope="module")
def keys() -> tuple[Any, bytes]:
    """The custodian's (secret context, public context bytes), once per module."""
    secret, public = he.generate_keys(PARAMS)
    return he.load_secret_context(secret, PARAMS, PARAMS.context_max_bytes(True)), public


@dataclass
class Built:
    root: Path  # the aggregator workspace
    plaintext_sha256: str
    sum_sha256: str

    @property
    def log(self) -> Path:
        return self.root / LOG_FILE

    @property
    def archive(self) -> Path:
        return self.root / ARCHIVE_DIR

    def verify(self) -> VerifyResult:
        return verify_log(self.log, self.archive, self.root)

    def problem(self) -> str:
        result = self.verify()
        assert not result.ok, result.as_dict()
        assert result.problem and "Traceback" not in result.problem
        return result.problem

    def entry_index(self, kind: str, nth: int = 0) -> int:
        """Index of the ``nth`` entry of ``kind`` (-1: the last)."""
        lines = self.log.read_bytes().splitlines()
        return [i for i, line in enumerate(lines) if json.loads(line)["kind"] == kind][nth]


def _config() -> str:
    text = default_federation_toml(FID)
    text = text.replace('secure_sum = "secagg"', 'secure_sum = "he"', 1)
    text = text.replace('custodian = ""', f'custodian = "{CUSTODIAN}"', 1)
    text = text.replace("poly_modulus_degree = 8192", "poly_modulus_degree = 4096", 1)
    return text.replace("coeff_mod_bit_sizes = [60, 60]", "coeff_mod_bit_sizes = [60, 49]", 1)


def build(
    root: Path,
    keys: tuple[Any, bytes],
    *,
    uploaders: tuple[str, ...] = AGENTS[:3],
    contributors: list[str] | None = None,
    sum_sha256: str | None = None,
    decryption_signer: Callable[[dict[str, SigningIdentity]], SigningIdentity] | None = None,
    applied: Callable[[IntVector], IntVector] = lambda ints: ints,
    rounds: int = 1,
    retention_rounds: int = 0,
    decrypt_message: bool = False,
    late_committer: str | None = None,
    recommitter: str | None = None,
) -> Built:
    """HE rounds' records in ``root``; the keyword arguments bend one thing (in every round).

    Args:
        uploaders: members whose ciphertext the log accepts.
        contributors: the decryption statement's list (default: the uploaders, sorted).
        sum_sha256: the statement's sum digest (default: the true one).
        decryption_signer: picks who signs the statement from the identities by id
            (default: the custodian).
        applied: what the aggregator applies in place of the plaintext it logged (its
            ``aggregate`` entry still hashes the logged one).
        rounds: how many rounds (1, 2, ...), each closed.
        retention_rounds: the archive retention the aggregator prunes with at each close.
        decrypt_message: also log the custodian's upload as an ``accepted`` message of
            stage decrypt (what the aggregator stores to replay it on resume).
        late_committer: an uploader whose commitment is logged after the others'
            ciphertexts (as a colluder's, made from them, would be).
        recommitter: an uploader whose ciphertext is not the one it committed to.
    """
    bend = Bend(
        uploaders,
        contributors,
        sum_sha256,
        decryption_signer,
        applied,
        decrypt_message,
        late_committer,
        recommitter,
    )
    ws = init_workspace(root, FID, config_text=_config())
    try:
        federation = _Federation(ws, keys)
        built = [federation.round(r, bend, retention_rounds) for r in range(1, rounds + 1)]
        return built[-1]
    finally:
        ws.close()


@dataclass(frozen=True)
class Bend:
    uploaders: tuple[str, ...]
    contributors: list[str] | None
    sum_sha256: str | None
    decryption_signer: Callable[[dict[str, SigningIdentity]], SigningIdentity] | None
    applied: Callable[[IntVector], IntVector]
    decrypt_message: bool
    late_committer: str | None = None
    recommitter: str | None = None


class _Federation:
    """The aggregator's workspace and log, the members' and the custodian's keys."""

    def __init__(self, ws: Workspace, keys: tuple[Any, bytes]) -> None:
        self.ws, (self.secret_ctx, public_bytes) = ws, keys
        cfg, task, admin = ws.config, get_task("breast_cancer"), ws.admin()
        self.task = task
        self.ids = {name: SigningIdentity.generate() for name in (*AGENTS, CUSTODIAN)}
        for name, identity in self.ids.items():
            role: Role = "custodian" if name == CUSTODIAN else "agent"
            ws.roster.add(
                sign_roster_entry(
                    federation_id=FID,
                    agent_id=name,
                    public_key=identity.public_bytes,
                    role=role,
                    admin=admin,
                )
            )
        self.trail = trail = AuditTrail(ws.root, ws.state.log, ws.signer, FID)
        trail.genesis(
            GenesisEntry(
                federation_id=FID,
                aggregator_public_key=ws.signer.public_bytes.hex(),
                admin_public_key=ws.admin_public.hex(),
                task=task.name,
                task_version=task.version,
                schema_fingerprint=task.schema.fingerprint(),
                server=_builtins(cfg.server),
                round=_builtins(cfg.round),
            )
        )
        trail.sync_roster(ws.roster)
        trail.sync_models(ws.models)
        # the custodian's public context, archived by its SHA-256 and logged as its statement
        self.context_sha = trail.keep(public_bytes)
        trail.append(
            wire.HeContextStatement(
                federation_id=FID,
                custodian=CUSTODIAN,
                poly_modulus_degree=PARAMS.poly_modulus_degree,
                coeff_mod_bit_sizes=list(PARAMS.coeff_mod_bit_sizes),
                scale_bits=PARAMS.scale_bits,
                context_sha256=self.context_sha,
            ).sign(self.ids[CUSTODIAN])
        )
        self.public = he.load_public_context(public_bytes, PARAMS, PARAMS.context_max_bytes(False))
        self.rng = np.random.default_rng(7)

    def commit(self, round_: int, member: str, body: bytes, bend: Bend) -> None:
        """Log ``member``'s signed commitment to ``body``'s hash (to another encryption's,
        for ``bend.recommitter``)."""
        if member == bend.recommitter:
            body = body + b"another encryption"
        digest = hashlib.sha256(body).hexdigest()
        signed = wire.CiphertextCommitment(
            federation_id=FID, round=round_, attempt=ATTEMPT, member=member, vector_sha256=digest
        ).sign(self.ids[member])
        raw = wire.encode(wire.CommitBody(digest, signed.signature))
        self.trail.append(
            AcceptedEntry(
                round=round_,
                attempt=ATTEMPT,
                stage="commit",
                member=member,
                sha256=self.trail.keep(raw),
                bytes=len(raw),
                commitment=digest,
                signature=signed.signature,
            )
        )
        self.commits.append((member, digest))

    def round(self, round_: int, bend: Bend, retention_rounds: int) -> Built:
        ws, trail, ids, task = self.ws, self.trail, self.ids, self.task
        self.commits: list[tuple[str, str]] = []
        cfg = ws.config
        parent = ws.models.latest()
        model = task.build_model(0)
        dim = flatten_params(model).size
        trail.append(RoundOpenEntry(round=round_, attempt=ATTEMPT))
        spec = _spec(ws, task, round_, parent.version, parent.sha256, dim, self.context_sha)
        trail.append(spec)

        # members: quantize as a plain round does, encrypt, commit to the ciphertexts'
        # hashes, then upload them and get accepted
        quant = spec.quant_spec()
        total = he.CiphertextSum(self.public, PARAMS, dim + 1)
        integer_sum = np.zeros(dim + 1, dtype=np.int64)
        encrypted: dict[str, tuple[IntVector, bytes]] = {}
        for member in bend.uploaders:
            delta = self.rng.normal(0.0, 0.02, dim).astype(np.float32)
            weight = 0.5 + 0.1 * AGENTS.index(member)
            quantized = quantize(delta, weight, quant, os.urandom(32))
            body = he.frame_chunks(he.encrypt(self.public, quantized.astype(np.float64)))
            encrypted[member] = (quantized, body)
        on_time = [m for m in bend.uploaders if m != bend.late_committer]
        for member in on_time:
            self.commit(round_, member, encrypted[member][1], bend)
        for member in bend.uploaders:
            if member == bend.late_committer:
                self.commit(round_, member, encrypted[member][1], bend)
            quantized, body = encrypted[member]
            statement = wire.ContributionStatement(
                federation_id=FID,
                round=round_,
                attempt=ATTEMPT,
                member=member,
                vector_sha256=hashlib.sha256(body).hexdigest(),
                commitment=hashlib.sha256(b"salt" + quantized.tobytes()).hexdigest(),
                commitments_sha256=wire.commitments_digest(self.commits),
            ).sign(ids[member])
            trail.append(
                AcceptedEntry(
                    round=round_,
                    attempt=ATTEMPT,
                    stage="masked_input",
                    member=member,
                    sha256=trail.keep(body),
                    bytes=len(body),
                    commitment=statement.commitment,
                    signature=statement.signature,
                )
            )
            total.add(he.unframe_chunks(body, PARAMS, dim + 1))
            integer_sum += quantized.astype(np.int64)

        # the custodian: decrypt, round, release the integer sum as <i8, sign the statement
        decrypted = he.decrypt_sum(self.secret_ctx, total.serialize(), dim + 1)
        ints = np.rint(decrypted).astype(np.int64)
        assert float(np.max(np.abs(decrypted - ints))) < 0.25
        assert np.array_equal(ints, integer_sum)  # CKKS holds the exact integer sum
        plaintext = ints.astype("<i8").tobytes()
        named = sorted(bend.uploaders) if bend.contributors is None else bend.contributors
        pick = bend.decryption_signer
        decryption = wire.DecryptionStatement(
            federation_id=FID,
            round=round_,
            attempt=ATTEMPT,
            custodian=CUSTODIAN,
            contributors=named,
            sum_sha256=total.digest() if bend.sum_sha256 is None else bend.sum_sha256,
            plaintext_sha256=trail.keep(plaintext),
        ).sign(ids[CUSTODIAN] if pick is None else pick(ids))
        if bend.decrypt_message:
            statement_json = wire.encode(decryption)
            upload = len(statement_json).to_bytes(4, "little") + statement_json + plaintext
            trail.append(
                AcceptedEntry(
                    round=round_,
                    attempt=ATTEMPT,
                    stage="decrypt",
                    member=CUSTODIAN,
                    sha256=trail.keep(upload),
                    bytes=len(upload),
                )
            )
        trail.append(decryption)

        # the aggregator: the ring sum -> (Σ w·Δ, Σ w) -> FedAvg -> the new version
        ring = (ints & quant.ring_mask).astype(quant.dtype)  # what the aggregate entry hashes
        applied = (bend.applied(ints) & quant.ring_mask).astype(quant.dtype)
        weighted, weights = dequantize_sum(applied, len(set(named)), quant)
        stored = ws.models.read(parent.version)
        arrays_to_state(model, decode_model(stored, max_bytes=MAX_MODEL_BYTES))
        lr = float(cfg.server.server_lr)
        mean = (weighted / weights).astype(np.float32)
        new, _ = server_step(FedAvg(lr), flatten_params(model), mean, None)
        load_flat_params(model, new)
        ws.models.put(
            state_to_arrays(model),
            parent=parent.version,
            round=round_,
            kind="aggregate",
            metrics={},
        )
        trail.append(
            AggregateEntry(
                round=round_,
                attempt=ATTEMPT,
                survivors=sorted(set(named)),
                dropped=sorted(set(spec.cohort) - set(named)),
                sum_sha256=hashlib.sha256(ring.tobytes()).hexdigest(),  # as SecAgg+
                weight_sum=weights,
                parent_version=parent.version,
                optimizer=cfg.server.optimizer,
                server_lr=lr,
            )
        )
        trail.sync_models(ws.models)
        trail.prune_archive(retention_rounds)
        trail.sign_head()
        return Built(ws.root, decryption.plaintext_sha256, decryption.sum_sha256)


def _builtins(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(section)
    return out


def _spec(
    ws: Workspace,
    task: Any,
    round_: int,
    version: int,
    model_sha: str,
    dim: int,
    context_sha: str,
) -> wire.RoundSpec:
    cfg = ws.config.round
    return wire.RoundSpec(
        federation_id=FID,
        round=round_,
        attempt=ATTEMPT,
        secure_sum="he",
        model_version=version,
        model_sha256=model_sha,
        task=task.name,
        task_version=task.version,
        schema_fingerprint=task.schema.fingerprint(),
        cohort=list(AGENTS),
        neighbors=0,
        threshold=0,
        quant_bits=cfg.quant_bits,
        ring_bits=default_ring_bits(cfg.quant_bits, len(AGENTS)),
        clip_norm=cfg.clip_norm,
        dim=dim,
        seed="00" * 32,
        max_weight_samples=cfg.max_weight_samples,
        weight_caps={},
        training=wire.TrainingSpec(local_epochs=1, batch_size=32, lr=0.05, optimizer="sgd"),
        dp=wire.DPSpec(enabled=False, noise_multiplier=0.0, max_grad_norm=1.0, delta=1e-5),
        deadlines={"masked_input_s": cfg.masked_s, "decrypt_s": cfg.decrypt_s},
        he_context_sha256=context_sha,
        custodian=CUSTODIAN,
    ).sign(ws.signer)


# -- the honest round ----------------------------------------------------------------------------


def test_honest_he_round_verifies(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(tmp_path / "ws", keys)
    result = built.verify()
    assert result.ok, result.problem
    assert (result.rounds_verified, result.models_verified) == (1, 1)
    assert result.pruned_rounds == []


def test_honest_he_round_verifies_from_the_cli(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(tmp_path / "ws", keys)
    out = CliRunner().invoke(main, ["audit", "verify", "--workspace", str(built.root), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["ok"] and doc["rounds_verified"] == 1 and doc["models_verified"] == 1


def test_report_lists_the_context_and_the_decryption(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    built = build(tmp_path / "ws", keys)
    page, result = build_report(built.log, built.archive, built.root)
    assert result.ok, result.problem
    assert f"key custodian {CUSTODIAN} published the public CKKS context" in page
    assert "decrypted the sum of 3 contributions of round 1 attempt 0" in page


def test_pruned_he_round_is_reported_as_pruned(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    # retention 1: round 2's close prunes round 1's ciphertexts (the aggregator's own code)
    built = build(tmp_path / "ws", keys, rounds=2, retention_rounds=1)
    pruning = built.entry_index("archive_pruned")
    result = built.verify()
    assert result.ok, result.problem
    assert result.pruned_rounds == [
        {"round": 1, "log_entry": pruning, "detail": f"pruned by retention (log entry {pruning})"}
    ]
    assert (result.rounds_verified, result.models_verified) == (1, 1)  # round 2


def test_decrypt_message_of_the_custodian_is_accepted(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    built = build(tmp_path / "ws", keys, rounds=2, retention_rounds=1, decrypt_message=True)
    result = built.verify()
    assert result.ok, result.problem
    assert [p["round"] for p in result.pruned_rounds] == [1]


def test_without_the_archive_signatures_and_contributors_are_still_checked(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    built = build(tmp_path / "ws", keys, contributors=["agent-1", "agent-2", "agent-4"])
    result = verify_log(built.log, None, None)
    assert not result.ok
    assert result.problem is not None and "agent-4" in result.problem


# -- what a dishonest aggregator or custodian could log ------------------------------------------


def test_wrong_sum_digest_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(tmp_path / "ws", keys, sum_sha256="ab" * 32)
    problem = built.problem()
    index = built.entry_index("he_decryption")
    assert f"log entry {index} (he_decryption)" in problem
    assert "re-adding the 3 archived ciphertexts" in problem
    assert "abababababababab" in problem


def test_contributor_not_accepted_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    # agent-4 is in the cohort but sent nothing; agent-3's accepted input is left out
    built = build(tmp_path / "ws", keys, contributors=["agent-1", "agent-2", "agent-4"])
    problem = built.problem()
    assert f"log entry {built.entry_index('he_decryption')} (he_decryption)" in problem
    assert "agent-4, who have no accepted masked input in round 1 attempt 0" in problem


def test_accepted_input_left_out_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(
        tmp_path / "ws", keys, uploaders=AGENTS, contributors=["agent-1", "agent-2", "agent-3"]
    )
    problem = built.problem()
    assert "the accepted masked input(s) of agent-4 (log entries [" in problem
    assert "are not among its contributors" in problem


def test_member_counted_twice_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(tmp_path / "ws", keys, contributors=["agent-1", "agent-2", "agent-2", "agent-3"])
    problem = built.problem()
    assert f"log entry {built.entry_index('he_decryption')} (he_decryption)" in problem
    assert "it counts agent-2 more than once" in problem


def test_a_commitment_logged_after_ciphertexts_is_reported(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    """A colluder that had the honest ciphertexts before committing (to build
    ``Enc(c) − Σ`` of them) could only have its commitment logged after them."""
    built = build(tmp_path / "ws", keys, uploaders=AGENTS, late_committer="agent-4")
    problem = built.problem()
    assert "a ciphertext commitment logged after a ciphertext" in problem


def test_a_ciphertext_not_the_committed_one_is_reported(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    built = build(tmp_path / "ws", keys, recommitter="agent-2")
    problem = built.problem()
    assert "agent-2's ciphertext is not one it committed to" in problem


def test_fewer_than_min_agents_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(tmp_path / "ws", keys, uploaders=("agent-1", "agent-2"))
    problem = built.problem()
    assert f"log entry {built.entry_index('he_decryption')} (he_decryption)" in problem
    assert "a sum of 2 contribution(s), fewer than the federation's round.min_agents = 3" in (
        problem
    )


def test_forged_custodian_signature_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    # signed by a member's key (a roster key, but not the custodian's)
    built = build(tmp_path / "ws", keys, decryption_signer=lambda ids: ids["agent-1"])
    problem = built.problem()
    assert f"log entry {built.entry_index('he_decryption')} (he_decryption)" in problem
    assert f"does not verify under custodian {CUSTODIAN}'s roster key" in problem


def test_plaintext_not_matching_its_hash_is_reported(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    built = build(tmp_path / "ws", keys)
    path = built.archive / built.plaintext_sha256[:2] / built.plaintext_sha256
    data = bytearray(path.read_bytes())
    data[0] ^= 1  # the released sum altered after the custodian hashed and signed it
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    problem = built.problem()
    assert f"log entry {built.entry_index('he_decryption')} (he_decryption)" in problem
    assert "plaintext of the custodian's decryption" in problem
    assert f"archive object {built.plaintext_sha256} holds content with sha256" in problem


def test_missing_plaintext_is_reported(tmp_path: Path, keys: tuple[Any, bytes]) -> None:
    built = build(tmp_path / "ws", keys)
    (built.archive / built.plaintext_sha256[:2] / built.plaintext_sha256).unlink()
    problem = built.problem()
    assert "plaintext of the custodian's decryption) is missing" in problem
    assert "no archive_pruned entry records its deletion" in problem


def test_plaintext_that_rederives_another_model_is_reported(
    tmp_path: Path, keys: tuple[Any, bytes]
) -> None:
    def shifted(ints: IntVector) -> IntVector:
        out = ints.copy()
        out[0] += 1  # one quantization level on one coordinate
        return out

    built = build(tmp_path / "ws", keys, applied=shifted)
    problem = built.problem()
    assert f"log entry {built.entry_index('model_version', -1)} (model_version)" in problem
    assert "re-deriving it from version 1 and the round's sum gives" in problem
