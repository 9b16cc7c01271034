"""What an agent keeps about each round it took part in: receipts, records, audit material.

Layout under the agent's ``state_dir``::

    receipts/r<round:06d>-a<attempt>.json   the aggregator's signed receipt
    records/r<round:06d>-a<attempt>.json    local record: epsilon, samples, hash sent, ...
    vault/r<round:06d>-a<attempt>.update.npy   the quantized (unmasked) update
    vault/r<round:06d>-a<attempt>.salt.npy     32 random bytes for its audit commitment

Receipts prove the aggregator accepted a contribution (anyone can check them against
the aggregator key).  The vault keeps the exact quantized update the masked input
hid, and a salt, so that the agent can later commit to it and reveal it to an
auditor; both are as sensitive as the update itself, so they are written 0600 and
never leave the machine unless an audit asks.  ``.npy`` files are written with
``allow_pickle=False`` and read the same way: nothing here is ever unpickled.

Every file is written atomically (temp file, fsync, rename, fsync of the directory),
so a crash leaves the previous file or the new one, never a torn one.
"""

from __future__ import annotations

import io
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from fedsec import fsio
from fedsec.errors import IntegrityError
from fedsec.protocol.wire import Receipt

__all__ = ["SALT_BYTES", "RoundRecord", "Vault", "VaultEntry"]

#: Salt of an audit commitment H(salt || update): 256 bits, so the commitment hides
#: the update even from a guesser who knows every other coordinate.
SALT_BYTES: Final = 32
#: Records and receipts are a few hundred bytes; refusing larger files bounds what a
#: corrupted state directory can cost to read.
MAX_RECORD_BYTES: Final = 1024 * 1024

_NAME = re.compile(r"^r(\d{6,})-a(\d+)\.json$")
_S = TypeVar("_S")


class RoundRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The agent's own account of one round attempt it contributed to."""

    federation_id: str
    round: int
    attempt: int
    member: str
    dataset_id: str
    model_version: int
    secure_sum: str
    epsilon: float  # total spent on the dataset after this round
    samples: int
    weight: float
    steps: int
    contribution_sha256: str  # sha256 of the exact bytes sent as the masked input
    receipt_log_index: int | None
    recorded_at: float
    # distributed DP: the kept update carries only this member's noise share, so it is
    # never revealed to an auditor (fedsec.agent.runtime.AgentRuntime.answer_challenges)
    dp_mode: str = "local"


@dataclass(frozen=True)
class VaultEntry:
    """A kept quantized update and its commitment salt."""

    update: npt.NDArray[np.unsignedinteger]
    salt: bytes


def _stem(round: int, attempt: int) -> str:
    if round < 0 or attempt < 0:
        raise ValueError(f"round and attempt must be >= 0, got {round}/{attempt}")
    return f"r{round:06d}-a{attempt}"


def atomic_write(path: Path, body: bytes, mode: int = 0o600) -> None:
    """Durable write inside the vault (private directories, 0600 files by default)."""
    fsio.atomic_write(path, body, mode=mode, parents_mode=0o700)


class Vault:
    """Receipts, round records and audit material of one agent, under ``state_dir``."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir)
        self.receipts_dir = self.root / "receipts"
        self.records_dir = self.root / "records"
        self.vault_dir = self.root / "vault"

    # -- receipts -----------------------------------------------------------------------

    def save_receipt(self, receipt: Receipt) -> Path:
        """Store a (verified) receipt for its round and attempt."""
        path = self.receipts_dir / f"{_stem(receipt.round, receipt.attempt)}.json"
        atomic_write(path, msgspec.json.encode(receipt), mode=0o644)
        return path

    def receipts(self) -> list[Receipt]:
        """Every stored receipt, oldest round first.

        Raises:
            IntegrityError: a receipt file is malformed.
        """
        return [self._read(p, Receipt) for p in self._listing(self.receipts_dir)]

    # -- records ------------------------------------------------------------------------

    def save_record(self, record: RoundRecord) -> Path:
        """Store the local record of a round attempt."""
        path = self.records_dir / f"{_stem(record.round, record.attempt)}.json"
        atomic_write(path, msgspec.json.encode(record), mode=0o600)
        return path

    def records(self) -> list[RoundRecord]:
        """Every stored record, oldest round first.

        Raises:
            IntegrityError: a record file is malformed.
        """
        return [self._read(p, RoundRecord) for p in self._listing(self.records_dir)]

    # -- audit material ---------------------------------------------------------------

    def keep_update(
        self, round: int, attempt: int, update: npt.NDArray[np.unsignedinteger]
    ) -> bytes:
        """Keep the quantized update with a fresh random salt; return the salt.

        Both files are 0600.  The salt is drawn here, from the OS CSPRNG, so it is
        never reused across rounds.
        """
        stem = _stem(round, attempt)
        salt = secrets.token_bytes(SALT_BYTES)
        atomic_write(self.vault_dir / f"{stem}.update.npy", _npy(np.ascontiguousarray(update)))
        atomic_write(self.vault_dir / f"{stem}.salt.npy", _npy(np.frombuffer(salt, np.uint8)))
        return salt

    def keep_update_once(
        self, round: int, attempt: int, update: npt.NDArray[np.unsignedinteger]
    ) -> bytes:
        """Like :meth:`keep_update`, but a retry of the same update keeps its first salt,
        so the commitment already sent stays openable."""
        try:
            kept = self.load_update(round, attempt)
        except IntegrityError:
            return self.keep_update(round, attempt, update)
        if np.array_equal(kept.update, update):
            return kept.salt
        return self.keep_update(round, attempt, update)

    def load_update(self, round: int, attempt: int) -> VaultEntry:
        """Read back a kept update and its salt.

        Raises:
            IntegrityError: missing or malformed files.
        """
        stem = _stem(round, attempt)
        update = _load_npy(self.vault_dir / f"{stem}.update.npy")
        salt = _load_npy(self.vault_dir / f"{stem}.salt.npy")
        if salt.dtype != np.uint8 or salt.shape != (SALT_BYTES,):
            raise IntegrityError(f"vault salt for {stem} is not {SALT_BYTES} bytes")
        if update.ndim != 1 or update.dtype.kind != "u":
            raise IntegrityError(f"vault update for {stem} is not a 1-D unsigned vector")
        return VaultEntry(update=update, salt=salt.tobytes())

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    def _listing(directory: Path) -> list[Path]:
        if not directory.is_dir():
            return []
        found = []
        for path in directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), int(match.group(2)), path))
        return [p for _, _, p in sorted(found)]

    @staticmethod
    def _read(path: Path, kind: type[_S]) -> _S:
        raw = path.read_bytes()
        if len(raw) > MAX_RECORD_BYTES:
            raise IntegrityError(f"{path} is {len(raw)} bytes, over {MAX_RECORD_BYTES}")
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise IntegrityError(f"{path} is malformed: {exc}") from None


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _load_npy(path: Path) -> np.ndarray:
    try:
        with path.open("rb") as fh:
            value = np.load(fh, allow_pickle=False)
    except FileNotFoundError:
        raise IntegrityError(f"vault file {path} does not exist") from None
    except ValueError as exc:
        raise IntegrityError(f"vault file {path} is malformed: {exc}") from None
    if not isinstance(value, np.ndarray):
        raise IntegrityError(f"vault file {path} does not hold one array")
    return value
