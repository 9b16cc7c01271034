"""Model versions: each manifest signed by the aggregator and matching its file, and
each round's version re-derived from its parent with the logged server optimiser,
bit for bit (a hidden version opened with a recipient's key first).

With FedAdam no version after a round whose sum is unknown (pruned, or its rule's
inputs not all logged) can be re-derived: the optimiser's moments depend on every
earlier round; nor any after a hidden version no key here opens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fedsec.audit.verifier import EntryProblem
from fedsec.audit.verifier.identity import Identities
from fedsec.derive import derive_model
from fedsec.errors import FedsecError
from fedsec.learning.optimizers import AdamMoments, FedAdam, FedAvg, ServerRule
from fedsec.modelfile import ModelManifest, verify_manifest
from fedsec.protocol import he_release, wire
from fedsec.protocol.log_entries import AggregateEntry, ModelVersionEntry, encode_body


class Models:
    """The logged model versions, and the versions re-derived awaiting their manifest."""

    def __init__(
        self,
        identities: Identities,
        models_root: Path | None,
        reader: tuple[bytes, bytes] | None,
    ) -> None:
        self.identities = identities
        self.models_root = models_root  # None: versions are not re-derived
        # (Ed25519 public key, X25519 secret) of a recipient of hidden models: the auditor's
        self.reader = reader
        self.manifests: dict[int, ModelManifest] = {}
        self.pending: dict[int, str] = {}  # round -> re-derived sha256 awaiting its manifest
        self.adam: AdamMoments | None = None  # FedAdam's moments, carried along the log
        self.adam_unknown = False  # a FedAdam round's sum is unknown: later moments are too
        # hidden versions re-derived here: sealed file sha256 -> the model in the clear
        self.clear_models: dict[str, bytes] = {}
        self.sealed_pending: dict[int, tuple[wire.DecryptionStatement, bytes]] = {}
        self.hidden_gap = False  # a hidden version was not opened: later parents unknown
        self.hidden_unopened = 0
        self.verified = 0

    def sum_unknown(self, body: AggregateEntry) -> None:
        """A round whose sum is not re-derived: FedAdam's later moments are unknown."""
        self.adam_unknown = self.adam_unknown or body.optimizer == "fedadam"

    def rederivable(self, body: AggregateEntry) -> bool:
        """Whether the version a round's aggregate makes can be re-derived here."""
        known = not (body.optimizer == "fedadam" and self.adam_unknown) and not self.hidden_gap
        return self.models_root is not None and known

    def model_bytes(self, digest: str) -> bytes:
        """The model file named ``digest`` (checked to be a sha256 hex, so it stays in
        models/), or the clear model of a hidden version opened here.

        Raises:
            EntryProblem: not a sha256 hex digest, or unreadable.
        """
        assert self.models_root is not None
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise EntryProblem(f"model reference {digest!r} is not a sha256 hex digest")
        if digest in self.clear_models:
            return self.clear_models[digest]
        path = self.models_root / "models" / f"{digest}.safetensors"
        try:
            return path.read_bytes()
        except OSError as exc:
            raise EntryProblem(f"model file {path} cannot be read ({exc.strerror})") from None

    def open_hidden(
        self, spec: wire.RoundSpec, statement: wire.DecryptionStatement, rest: bytes, what: str
    ) -> bytes | None:
        """The plaintext of a hidden model's release ``rest``, opened with the reader's
        key (None without one: the version and every later one are then not re-derived).

        Raises:
            EntryProblem: the key is on no active roster entry, or the release does not open.
        """
        if self.reader is None:
            self.hidden_unopened += 1
            self.hidden_gap = True
            return None
        public, secret = self.reader
        member = self.identities.reader_member(public)
        if member is None:
            raise EntryProblem("the key given to open hidden models is on no active roster entry")
        try:
            opened = he_release.open_sealed(statement, rest, member, secret, spec.dim + 1)
        except FedsecError as exc:
            raise EntryProblem(f"the archived {what} does not open: {exc.detail}") from None
        self.sealed_pending[spec.round] = (statement, opened.model)
        return opened.plaintext

    def rederive(self, body: AggregateEntry, spec: wire.RoundSpec, sums: Any) -> None:
        """The round's version from its parent and (Σ w·Δ, Σ w), kept for its manifest.

        Raises:
            EntryProblem: the parent was never logged, or a hidden model re-derives to
                another than the custodian sealed.
        """
        parent = self.manifests.get(body.parent_version)
        if parent is None:
            raise EntryProblem(f"parent version {body.parent_version} was never logged")
        data = self.model_bytes(parent.sha256)
        weighted, weights = sums
        genesis = self.identities.genesis
        assert genesis is not None  # entry 0, checked first
        rule = _logged_rule(body, genesis.server)
        model, self.adam = derive_model(spec.task, data, weighted, weights, rule, self.adam)
        digest = hashlib.sha256(model).hexdigest()
        hidden = self.sealed_pending.get(spec.round)
        if hidden is not None:
            statement, released = hidden
            if digest != statement.model_sha256 or model != released:
                raise EntryProblem(
                    f"re-deriving the hidden model of round {spec.round} gives {digest[:16]}…, "
                    f"but the custodian sealed model {str(statement.model_sha256)[:16]}…"
                )
            digest = statement.model_sha256
        self.pending[spec.round] = digest

    def on_model_version(self, body: ModelVersionEntry) -> None:
        """Raises: EntryProblem, FedsecError: unsigned, not its file, not the version
        re-derived, or a rollback to other weights."""
        manifest = ModelManifest.from_json(json.dumps(encode_body(body)).encode())
        data = None
        if self.models_root is not None:
            data = self.model_bytes(manifest.sha256)
        identities = self.identities
        verify_manifest(
            manifest, identities.aggregator_key, data, federation_id=identities.federation_id
        )
        if manifest.kind == "sealed" and manifest.round in self.pending:
            self._check_sealed_version(manifest, data)
        elif manifest.kind == "aggregate" and manifest.round in self.pending:
            expected = self.pending.pop(manifest.round)
            if expected != manifest.sha256:
                raise EntryProblem(
                    f"model version {manifest.version} has sha256 {manifest.sha256[:16]}…, but "
                    f"re-deriving it from version {manifest.parent} and the round's sum gives "
                    f"{expected[:16]}…"
                )
            self.verified += 1
        if manifest.kind == "rollback":
            parent = self.manifests.get(manifest.parent or -1)
            if parent is None or parent.sha256 != manifest.sha256:
                raise EntryProblem("a rollback must carry exactly the weights of its target")
        self.manifests[manifest.version] = manifest

    def _check_sealed_version(self, manifest: ModelManifest, data: bytes | None) -> None:
        """A hidden version: its file is the logged release, and the model inside is the
        one re-derived (kept in the clear as the parent of the next version)."""
        assert manifest.round is not None  # in pending
        expected = self.pending.pop(manifest.round)
        statement, model = self.sealed_pending.pop(manifest.round)
        if data is not None:
            try:
                stored, rest = he_release.unframe(data, he_release.MAX_STATEMENT_BYTES)
            except FedsecError as exc:
                raise EntryProblem(f"sealed version {manifest.version}: {exc.detail}") from None
            if stored != statement or hashlib.sha256(rest).hexdigest() != statement.sealed_sha256:
                raise EntryProblem(
                    f"sealed version {manifest.version} is not the release the custodian's "
                    "logged decryption names"
                )
        assert expected == statement.model_sha256
        self.clear_models[manifest.sha256] = model
        self.verified += 1


def _logged_rule(body: AggregateEntry, server: dict[str, Any]) -> ServerRule:
    """The server optimiser an aggregate entry names; FedAdam's settings are the genesis ones."""
    lr = float(body.server_lr)
    if body.optimizer == "fedadam":
        beta1, beta2, tau = server["adam_beta1"], server["adam_beta2"], server["adam_tau"]
        return FedAdam(lr, float(beta1), float(beta2), float(tau))
    return FedAvg(lr)
