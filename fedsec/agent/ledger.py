"""The privacy ledger: how much of each dataset's (epsilon, delta) budget is spent.

One JSON file in the agent's state directory holds, per dataset id, the budget and
the history of DP rounds trained on it (noise multiplier, sample rate, steps). Spent
epsilon is always recomputed by composing the whole history: adding per-round epsilons
would overstate the cost badly, and caching a total would let it drift from the
history that justifies it.

The accountant (PRV, capped by RDP) is :mod:`fedsec.agent.accountant`.

Durability: every change is written through :func:`fedsec.fsio.atomic_write` (a temp
file, fsynced, renamed over the ledger, the directory fsynced), so a crash leaves
either the old or the new ledger, never a torn one. Read-modify-write cycles hold an
exclusive lock on a side file, so two agent processes sharing a state directory cannot
lose a round.
A ledger that cannot be parsed is an error, never silently reset: resetting would
forget privacy already spent.

Each charge's report names its index in the history, and declares every earlier charge
whose report no aggregator took (``reported_through`` marks how far they were taken), so
an auditor recomputes ε from the log alone even when a member was charged for a round it
then dropped out of.

Charge a round *before* training it (:meth:`PrivacyLedger.charge`, or
:meth:`~PrivacyLedger.check_can_train` then :meth:`~PrivacyLedger.record`): a crash
after training but before recording would otherwise spend privacy off the books.

Releases: the accountant composes one mechanism per charge, so a charge may be released
once.  Before an update goes into a SecAgg+ sum the agent records the attempt it is
released to (:meth:`PrivacyLedger.record_release`, durable like every change), and the
ledger refuses to release the same charge to a second attempt: an aggregator that takes
an attempt to its unmask, aborts it and sums the same updates again without one member
would otherwise subtract that member's update out of the two sums, and under
distributed DP every sum carries fresh noise that one charge does not pay for.  A
retried attempt after a release is trained and charged anew
(:meth:`fedsec.agent.charging.Carryover.reusable`).

A gossip peer (:mod:`fedsec.peer.privacy`) charges the same ledger the same way, each
charge naming it as ``holder`` and marked released before its update leaves, so that a
restarted peer reuses the charge of an update that never left instead of paying twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# epsilon_of, rdp_epsilon and noise_for_budget are re-exported: callers read ε where
# they read the ledger
from fedsec.agent.accountant import epsilon_of as epsilon_of
from fedsec.agent.accountant import noise_for_budget as noise_for_budget
from fedsec.agent.accountant import rdp_epsilon as rdp_epsilon
from fedsec.agent.accountant import validate_round
from fedsec.errors import BudgetExhausted, ConfigError, IntegrityError
from fedsec.fsio import atomic_write

LEDGER_FILENAME = "privacy_ledger.json"
LEDGER_FORMAT = "fedsec.privacy_ledger"
LEDGER_VERSION = 1


@dataclass(frozen=True)
class RoundCharge:
    """One DP training round as the accountant sees it."""

    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    recorded_at: str = ""
    # (round, attempt) whose SecAgg+ sum took the update trained on this charge
    released_to: tuple[int, int] | None = None
    # who charged it when not the agent ("" for the agent): a gossip peer finds its own
    # unreleased charge by it after a restart (fedsec.peer.privacy)
    holder: str = ""


@dataclass(frozen=True)
class LedgerCharge:
    """A training just charged: its place in the dataset's history, the total ε after
    it, and the earlier charges whose reports no aggregator has taken yet."""

    index: int
    epsilon: float
    unreported: tuple[tuple[int, RoundCharge], ...]


@dataclass(frozen=True)
class Budget:
    """A dataset's total privacy budget across all rounds."""

    epsilon: float
    delta: float


def _round_charge(item: dict[str, Any]) -> RoundCharge:
    return RoundCharge(
        round=int(item["round"]),
        noise_multiplier=float(item["noise_multiplier"]),
        sample_rate=float(item["sample_rate"]),
        steps=int(item["steps"]),
        recorded_at=str(item.get("recorded_at", "")),
        released_to=_released_to(item),
        holder=str(item.get("holder", "")),
    )


def _released_to(item: dict[str, Any]) -> tuple[int, int] | None:
    """The (round, attempt) a history item's update was released to, if any.

    Raises:
        ValueError / TypeError: not a pair of integers >= 0.
    """
    raw = item.get("released_to")
    if raw is None:
        return None
    round_, attempt = (int(v) for v in raw)
    if round_ < 0 or attempt < 0 or int(item["round"]) > round_:
        raise ValueError(
            f"'released_to' {raw!r} names an attempt before the round the charge paid for"
        )
    return round_, attempt


def _pure(entry: dict[str, Any]) -> float:
    """Sum of the ε of a dataset's pure ε-DP releases (basic composition)."""
    # math.fsum: a float even when there is none (0.0, never int 0: signed reports omit
    # a field at its default 0.0, and an int would be written)
    return math.fsum(float(item["epsilon"]) for item in entry.get("pure", []))


class PrivacyLedger:
    """Per-dataset privacy budgets and spending, persisted in ``state_dir``."""

    def __init__(self, state_dir: str | Path) -> None:
        """Open (or prepare to create) the ledger in ``state_dir``.

        Raises:
            IntegrityError: an existing ledger file is unreadable or malformed.
        """
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / LEDGER_FILENAME
        self._lock_path = self.state_dir / (LEDGER_FILENAME + ".lock")
        self._datasets: dict[str, dict[str, Any]] = self._read()

    # ---- reading -----------------------------------------------------------------

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            raw_text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise IntegrityError(f"privacy ledger {self.path} cannot be read: {exc}") from exc
        try:
            raw = json.loads(raw_text)
            return self._parse(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(
                f"privacy ledger {self.path} is corrupt ({exc}); refusing to reset it, since "
                "that would forget privacy already spent. Restore it from a backup."
            ) from exc

    @staticmethod
    def _parse(raw: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(raw, dict) or raw.get("format") != LEDGER_FORMAT:
            raise ValueError(f"not a {LEDGER_FORMAT} document")
        if raw.get("version") != LEDGER_VERSION:
            raise ValueError(f"unsupported ledger version {raw.get('version')!r}")
        datasets = raw["datasets"]
        if not isinstance(datasets, dict):
            raise TypeError("'datasets' must be an object")
        for dataset_id, entry in datasets.items():
            budget = entry["budget"]
            Budget(float(budget["epsilon"]), float(budget["delta"]))
            for item in entry["history"]:
                validate_round(
                    float(item["noise_multiplier"]), float(item["sample_rate"]), int(item["steps"])
                )
                int(item["round"])
                _released_to(item)
                if not isinstance(item.get("holder", ""), str):
                    raise TypeError("a charge's 'holder' must be a string")
            if not 0 <= int(entry.get("reported_through", 0)) <= len(entry["history"]):
                raise ValueError("'reported_through' must be within the history")
            for item in entry.get("pure", []):
                if not float(item["epsilon"]) > 0:
                    raise ValueError("a pure release's epsilon must be > 0")
            if not isinstance(dataset_id, str):
                raise TypeError("dataset ids must be strings")
        return datasets

    def _reload(self) -> None:
        self._datasets = self._read()

    def _entry(self, dataset_id: str) -> dict[str, Any]:
        entry = self._datasets.get(dataset_id)
        if entry is None:
            raise ConfigError(
                f"dataset '{dataset_id}' has no privacy budget in {self.path}; set one first"
            )
        return entry

    # ---- writing -----------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the ledger's lock and work on the freshest on-disk state."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self._lock_path.open("a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                self._reload()
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _write(self, datasets: dict[str, dict[str, Any]]) -> None:
        document = {"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "datasets": datasets}
        payload = json.dumps(document, indent=2, sort_keys=True).encode("utf-8")
        # 0600: its history says when this member trained, and on what
        atomic_write(self.path, payload, mode=0o600)
        self._datasets = datasets

    # ---- public API --------------------------------------------------------------

    def datasets(self) -> list[str]:
        """Ids of the datasets with a budget, sorted."""
        return sorted(self._datasets)

    def budget(self, dataset_id: str) -> Budget:
        """The budget of ``dataset_id``.

        Raises:
            ConfigError: the dataset has no budget.
        """
        raw = self._entry(dataset_id)["budget"]
        return Budget(float(raw["epsilon"]), float(raw["delta"]))

    def history(self, dataset_id: str) -> list[RoundCharge]:
        """Every round charged to ``dataset_id``, oldest first."""
        return [_round_charge(item) for item in self._entry(dataset_id)["history"]]

    def unreported(self, dataset_id: str, before: int) -> list[tuple[int, RoundCharge]]:
        """The charges of ``dataset_id`` before index ``before`` that no report the
        aggregator took has declared yet (see :meth:`mark_reported`), with their indexes.
        """
        entry = self._entry(dataset_id)
        start = int(entry.get("reported_through", 0))
        history = entry["history"]
        return [(i, _round_charge(history[i])) for i in range(start, min(before, len(history)))]

    def mark_reported(self, dataset_id: str, index: int) -> None:
        """Record that the aggregator took the report of charge ``index``, which
        declared every earlier charge not yet reported: none of them is declared again.
        Durable on return; an older index than one already marked changes nothing.

        Raises:
            ConfigError: no budget for the dataset, or ``index`` is not a charge of it.
        """
        with self._locked():
            entry = self._entry(dataset_id)
            if not 0 <= index < len(entry["history"]):
                raise ConfigError(
                    f"dataset '{dataset_id}' has no charge {index} to mark as reported"
                )
            if index + 1 <= int(entry.get("reported_through", 0)):
                return
            datasets = json.loads(json.dumps(self._datasets))
            datasets[dataset_id]["reported_through"] = index + 1
            self._write(datasets)

    def releases(self, dataset_id: str) -> dict[int, tuple[int, int]]:
        """Charge index -> the (round, attempt) its update was released to, for every
        released charge of ``dataset_id`` (none for a dataset without a budget)."""
        entry = self._datasets.get(dataset_id)
        if entry is None:
            return {}
        released = ((i, _released_to(item)) for i, item in enumerate(entry["history"]))
        return {i: to for i, to in released if to is not None}

    def last_held(self, dataset_id: str, holder: str) -> tuple[int, RoundCharge] | None:
        """The newest charge of ``dataset_id`` that ``holder`` made, with its index (None
        when it made none, or the dataset has no budget); read from the file, so a
        restarted process sees what the one before it charged."""
        self._reload()
        entry = self._datasets.get(dataset_id)
        history = [] if entry is None else entry["history"]
        for i in range(len(history) - 1, -1, -1):
            if str(history[i].get("holder", "")) == holder:
                return i, _round_charge(history[i])
        return None

    def ensure_budget(self, dataset_id: str, epsilon: float, delta: float) -> float:
        """Set the budget of ``dataset_id`` to ``epsilon``/``delta`` unless it is that
        already, and refuse to go on when nothing of it is left.

        Returns:
            the epsilon already spent.

        Raises:
            ConfigError: see :meth:`set_budget`.
            BudgetExhausted: the spent epsilon has reached the budget.
        """
        known = dataset_id in self._datasets
        budget = self.budget(dataset_id) if known else None
        if budget is None or (budget.epsilon, budget.delta) != (epsilon, delta):
            self.set_budget(dataset_id, epsilon, delta)
        spent = self.spent(dataset_id)
        if spent >= epsilon:
            raise BudgetExhausted(
                f"dataset '{dataset_id}': epsilon {spent:.2f} of the budget {epsilon:g} is "
                "already spent; refusing to train"
            )
        return spent

    def record_release(self, dataset_id: str, index: int, round: int, attempt: int) -> None:
        """Record that the update trained on charge ``index`` goes into the sum of
        ``round``'s ``attempt``; durable on return.  The same attempt again (a retried
        upload) changes nothing.

        Raises:
            ConfigError: no budget for the dataset, or ``index`` is not a charge of it.
            IntegrityError: the charge was already released to another attempt, or
                charged for a later round; the ledger is unchanged.  (A buffered member
                may send an update trained for an earlier round.)
        """
        with self._locked():
            entry = self._entry(dataset_id)
            if not 0 <= index < len(entry["history"]):
                raise ConfigError(f"dataset '{dataset_id}' has no charge {index} to release")
            item = entry["history"][index]
            if int(item["round"]) > round:
                raise IntegrityError(
                    f"dataset '{dataset_id}': charge {index} paid for round {item['round']}, "
                    f"after round {round}; refusing to release it there"
                )
            earlier = _released_to(item)
            if earlier == (round, attempt):
                return
            if earlier is not None:
                raise IntegrityError(
                    f"dataset '{dataset_id}': the update of charge {index} was already "
                    f"released to round {earlier[0]} attempt {earlier[1]}; sending it to "
                    f"attempt {attempt} too would let the aggregator difference the two sums "
                    "and would be a second release on one charge, so it is refused"
                )
            datasets = json.loads(json.dumps(self._datasets))
            datasets[dataset_id]["history"][index]["released_to"] = [int(round), int(attempt)]
            self._write(datasets)

    def set_budget(self, dataset_id: str, epsilon: float, delta: float) -> None:
        """Create or change the budget of ``dataset_id`` (durable on return).

        Epsilon may be changed at any time (the data owner's decision); delta may not
        change once rounds are recorded, because the spent epsilon is only meaningful
        against the delta it was accounted for.

        Raises:
            ConfigError: invalid values, or a delta change after spending.
        """
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise ConfigError(f"budget epsilon must be positive and finite, got {epsilon}")
        if not 0.0 < delta < 1.0:
            raise ConfigError(f"budget delta must be in (0, 1), got {delta}")
        with self._locked():
            datasets = json.loads(json.dumps(self._datasets))
            entry = datasets.setdefault(dataset_id, {"history": []})
            old = entry.get("budget")
            if old is not None and entry["history"] and float(old["delta"]) != delta:
                raise ConfigError(
                    f"dataset '{dataset_id}': budget delta cannot change from {old['delta']} "
                    f"to {delta} after {len(entry['history'])} recorded round(s)"
                )
            entry["budget"] = {"epsilon": float(epsilon), "delta": float(delta)}
            self._write(datasets)

    def spent(self, dataset_id: str) -> float:
        """Epsilon spent on ``dataset_id`` over all recorded rounds, at the budget's delta.

        Recomputed from the full history (PRV, capped by RDP; see the module doc).
        """
        return self.projected_after(dataset_id, [])

    def projected(
        self, dataset_id: str, noise_multiplier: float, sample_rate: float, steps: int
    ) -> float:
        """Total epsilon of ``dataset_id`` if one more round with these settings ran."""
        validate_round(noise_multiplier, sample_rate, steps)
        return self.projected_after(dataset_id, [(noise_multiplier, sample_rate, steps)])

    def projected_after(self, dataset_id: str, extra: list[tuple[float, float, int]]) -> float:
        """Total epsilon after the recorded history plus ``extra`` (nm, rate, steps) rounds."""
        entry = self._entry(dataset_id)
        history = [
            (float(i["noise_multiplier"]), float(i["sample_rate"]), int(i["steps"]))
            for i in entry["history"]
        ]
        # pure ε-DP releases (noised data-summary counts) compose with the DP-SGD
        # history by basic composition: their ε adds, their δ is 0
        return epsilon_of(history + list(extra), float(entry["budget"]["delta"])) + _pure(entry)

    def pure_spent(self, dataset_id: str) -> float:
        """Epsilon of the pure ε-DP releases of ``dataset_id`` (part of :meth:`spent`)."""
        return _pure(self._entry(dataset_id))

    def charge_pure(self, dataset_id: str, epsilon: float, what: str) -> float:
        """Check the budget and record one pure ε-DP release of ``dataset_id`` (e.g.
        Laplace-noised counts), atomically; call before releasing.

        Returns:
            the new total epsilon spent.

        Raises:
            BudgetExhausted: the release would exceed the budget; the ledger is unchanged.
            ConfigError: no budget for the dataset, or epsilon not a finite number > 0.
        """
        if not (math.isfinite(epsilon) and epsilon > 0):
            raise ConfigError(f"a pure release needs a finite epsilon > 0, got {epsilon}")
        with self._locked():
            total = self.spent(dataset_id) + epsilon
            budget = self.budget(dataset_id).epsilon
            if total > budget + 1e-12:
                raise BudgetExhausted(
                    f"dataset '{dataset_id}': {what} would spend epsilon {epsilon:g} more, "
                    f"{total:.3f} of the budget {budget:g}"
                )
            datasets = json.loads(json.dumps(self._datasets))
            datasets[dataset_id].setdefault("pure", []).append(
                {
                    "epsilon": float(epsilon),
                    "what": what,
                    "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
                }
            )
            self._write(datasets)
        return self.spent(dataset_id)

    def remaining(self, dataset_id: str) -> float:
        """Budget epsilon minus spent epsilon (negative only if the budget was lowered)."""
        return self.budget(dataset_id).epsilon - self.spent(dataset_id)

    def check_can_train(
        self,
        dataset_id: str,
        round: int,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
    ) -> float:
        """Refuse a round that would exceed the budget; return the projected total epsilon.

        Raises:
            BudgetExhausted: the projected total epsilon exceeds the budget.
            ConfigError: no budget for the dataset, or invalid round settings.
        """
        self._reload()
        budget = self.budget(dataset_id)
        projected = self.projected(dataset_id, noise_multiplier, sample_rate, steps)
        if projected > budget.epsilon:
            spent = self.spent(dataset_id)
            raise BudgetExhausted(
                f"dataset '{dataset_id}': training round {round} would spend epsilon "
                f"{projected:.2f} > budget {budget.epsilon:g} (spent {spent:.2f}); "
                "refusing to train"
            )
        return projected

    def record(
        self,
        dataset_id: str,
        round: int,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
    ) -> float:
        """Append a round to the history of ``dataset_id``; durable before returning.

        Recording does not check the budget (the privacy was spent, or is about to be);
        use :meth:`charge` to check and record in one locked step. A round number may
        appear twice: a retried round spends privacy twice.

        Returns:
            the new total epsilon spent.

        Raises:
            ConfigError: no budget for the dataset, or invalid round settings.
        """
        validate_round(noise_multiplier, sample_rate, steps)
        with self._locked():
            self._append(dataset_id, round, noise_multiplier, sample_rate, steps)
        return self.spent(dataset_id)

    def charge(
        self,
        dataset_id: str,
        round: int,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
        *,
        holder: str = "",
    ) -> LedgerCharge:
        """Check the budget and record the round atomically; call before training.
        ``holder`` names who charged when it is not the agent (see :meth:`last_held`).

        Returns:
            the charge's index, the new total epsilon spent, and the earlier charges
            whose reports were never taken (the report of this one declares them).

        Raises:
            BudgetExhausted: the round would exceed the budget; the ledger is unchanged.
            ConfigError: no budget for the dataset, or invalid round settings.
        """
        with self._locked():
            self.check_can_train(dataset_id, round, noise_multiplier, sample_rate, steps)
            self._append(dataset_id, round, noise_multiplier, sample_rate, steps, holder)
            index = len(self._entry(dataset_id)["history"]) - 1
            unreported = tuple(self.unreported(dataset_id, index))
        return LedgerCharge(index, self.spent(dataset_id), unreported)

    def _append(
        self,
        dataset_id: str,
        round: int,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
        holder: str = "",
    ) -> None:
        self._entry(dataset_id)
        datasets = json.loads(json.dumps(self._datasets))
        item: dict[str, Any] = {
            "round": int(round),
            "noise_multiplier": float(noise_multiplier),
            "sample_rate": float(sample_rate),
            "steps": int(steps),
            "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        if holder:  # the agent's charges keep the form they always had
            item["holder"] = holder
        datasets[dataset_id]["history"].append(item)
        self._write(datasets)
