"""The collusion harness: an attacker holding everything the aggregator holds (the public
context, every ciphertext, the log) and every key and transcript of one member, then of
all but one member, tries to read the remaining member's update.

It fails every way it tries: no context it holds can decrypt (members and aggregator hold
only the public context); homomorphic arithmetic on ciphertexts only yields ciphertexts;
the custodian refuses every sum that would isolate the target; its best guess is no
closer than an uninformed one.  Handed the custodian's secret context, the same routine
reads the target exactly, so the harness is known to bite.

The one thing no summation protects against is stated and tested last: once a sum of n
contributions is legitimately released, whoever knows n - 1 of them knows the last
(docs/threat-model.md: min_agents bounds the coalition, DP bounds what it learns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import tenseal as ts

from fedsec.crypto import he
from fedsec.crypto.identity import SigningIdentity
from fedsec.custodian.check import Refused, decide
from fedsec.protocol.wire import HeSumOffer

from .conftest import MEMBERS, PARAMS, QUANT_BITS, Federation

TARGET = "alice"
DIM = 2000  # one ciphertext at N = 4096: enough values for the guess's error to settle
# An uninformed guess of a value uniform on [0, L] is off by its standard deviation.
UNIFORM_STD = ((1 << QUANT_BITS) ** 2 - 1) ** 0.5 / 12**0.5


@dataclass
class MemberTranscript:
    """Everything one member holds: its key, the public context, its plaintext update and
    the ciphertext it uploaded."""

    identity: SigningIdentity
    public_context: bytes
    update: np.ndarray
    ciphertext: bytes


@dataclass
class AggregatorView:
    """Everything the aggregator holds before decryption."""

    public_context: bytes
    ciphertexts: dict[str, bytes]  # member -> framed ciphertext (the archive)
    log: bytes
    offer: HeSumOffer  # the honest sum it would ask the custodian to decrypt


@dataclass
class Outcome:
    guess: np.ndarray
    read_exactly: bool
    failures: list[str] = field(default_factory=list)


def attack(
    view: AggregatorView,
    colluders: dict[str, MemberTranscript],
    target: str,
    *,
    oracle: Any,
    secret_context: bytes | None = None,
) -> Outcome:
    """The attacker's routine: every avenue it has to the target's update, in turn."""
    dim = len(next(iter(colluders.values())).update)
    chunks = he.unframe_chunks(view.ciphertexts[target], PARAMS, dim)
    outcome = Outcome(guess=np.zeros(dim), read_exactly=False)
    contexts = [view.public_context, *(t.public_context for t in colluders.values())]
    if secret_context is not None:
        contexts.append(secret_context)
    for raw in contexts:  # 1. decrypt with every context it holds
        plain = _try_decrypt(raw, chunks, dim, outcome)
        if plain is not None:
            outcome.guess, outcome.read_exactly = np.rint(plain), True
            return outcome
    _try_subtraction(view, colluders, target, dim, outcome)  # 2. arithmetic on ciphertexts
    _try_isolating_offers(view, colluders, target, oracle, outcome)  # 3. the custodian
    known = [t.update.astype(np.float64) for t in colluders.values()]
    outcome.guess = np.mean(known, axis=0)  # 4. its best estimate without a decryption
    return outcome


def _try_decrypt(raw: bytes, chunks: list[bytes], dim: int, outcome: Outcome) -> Any:
    try:
        secret = he.load_secret_context(raw, PARAMS, PARAMS.context_max_bytes(secret=True))
    except he.CryptoError as exc:
        outcome.failures.append(f"load as secret: {exc.detail}")
    else:
        return he.decrypt_sum(secret, chunks, dim)
    try:  # bypass fedsec's checks: ask TenSEAL directly
        ctx = ts.context_from(raw)
        return np.asarray(ts.ckks_vector_from(ctx, chunks[0]).decrypt())
    except (ValueError, RuntimeError, TypeError) as exc:
        outcome.failures.append(f"TenSEAL decrypt: {exc}")
    return None


def _try_subtraction(
    view: AggregatorView,
    colluders: dict[str, MemberTranscript],
    target: str,
    dim: int,
    outcome: Outcome,
) -> None:
    """Σ all − Σ known is a ciphertext of what the others sent: still encrypted."""
    ctx = ts.context_from(view.public_context)
    total = None
    for body in view.ciphertexts.values():
        vec = ts.ckks_vector_from(ctx, he.unframe_chunks(body, PARAMS, dim)[0])
        total = vec if total is None else total + vec
    for transcript in colluders.values():
        total = total - ts.ckks_vector_from(
            ctx, he.unframe_chunks(transcript.ciphertext, PARAMS, dim)[0]
        )
    try:
        total.decrypt()
    except ValueError as exc:
        outcome.failures.append(f"decrypt the difference: {exc}")


def _try_isolating_offers(
    view: AggregatorView,
    colluders: dict[str, MemberTranscript],
    target: str,
    oracle: Any,
    outcome: Outcome,
) -> None:
    """Ask the custodian for sums that hold the target beside fewer honest members than
    the log's round: alone, with a colluder, with a colluder twice, with a made-up one."""
    mates = sorted(colluders)
    bodies = view.ciphertexts
    attempts: list[tuple[list[str], list[bytes]]] = [
        ([target], [bodies[target]]),
        ([target, mates[0]], [bodies[target], bodies[mates[0]]]),
        ([target, mates[0], mates[0]], [bodies[target], bodies[mates[0]], bodies[mates[0]]]),
        ([target, mates[0], "sybil"], [bodies[target], bodies[mates[0]], bodies[mates[0]]]),
        (sorted(view.offer.contributors), [bodies[target]] * len(view.offer.contributors)),
    ]
    for members, parts in attempts:
        try:
            oracle(members, parts)
        except Refused as exc:
            outcome.failures.append(f"custodian refused {members}: {exc.reason}")
        else:
            raise AssertionError(f"the custodian decrypted an isolating sum of {members}")


# -- the scenario --------------------------------------------------------------------------------


@pytest.fixture
def scenario(he_keys: tuple[bytes, bytes]) -> tuple[Federation, AggregatorView, Any]:
    federation = Federation(*he_keys, dim=DIM).setup()
    offer = federation.honest_round()
    logged = {
        e.body["member"]: e.body["sha256"]
        for e in federation.entries
        if e.kind == "accepted"
        and e.body["stage"] == "masked_input"
        and e.body["member"] in MEMBERS
    }
    view = AggregatorView(
        public_context=federation.public,
        ciphertexts={m: federation.archive[d] for m, d in logged.items()},
        log=federation.log_bytes(),
        offer=offer,
    )

    def oracle(members: Sequence[str], parts: Sequence[bytes]) -> Any:
        crafted = federation.offer(members, bodies=parts)
        return decide(crafted, federation.follower(), federation.fetch(), federation.custody())

    return federation, view, oracle


def transcripts(federation: Federation, view: AggregatorView, members: Sequence[str]) -> Any:
    return {
        m: MemberTranscript(
            identity=federation.members[m],
            public_context=federation.public,
            update=federation.plain[m],
            ciphertext=view.ciphertexts[m],
        )
        for m in members
    }


@pytest.mark.parametrize(
    "colluding", [("bob",), tuple(m for m in MEMBERS if m != TARGET)], ids=["one", "all_but_one"]
)
def test_colluders_cannot_read_another_members_update(
    scenario: tuple[Federation, AggregatorView, Any], colluding: tuple[str, ...]
) -> None:
    federation, view, oracle = scenario
    outcome = attack(view, transcripts(federation, view, colluding), TARGET, oracle=oracle)

    assert not outcome.read_exactly
    assert any("holds no secret key" in f for f in outcome.failures)
    assert any(f.startswith("TenSEAL decrypt") for f in outcome.failures)
    assert any(f.startswith("decrypt the difference") for f in outcome.failures)
    assert sum(f.startswith("custodian refused") for f in outcome.failures) == 5
    target = federation.plain[TARGET].astype(np.float64)
    error = float(np.sqrt(np.mean((outcome.guess - target) ** 2)))
    assert error >= 0.9 * UNIFORM_STD  # no closer than a guess that knows nothing


def test_the_same_attack_reads_the_update_with_the_custodians_key(
    scenario: tuple[Federation, AggregatorView, Any],
) -> None:
    federation, view, oracle = scenario
    outcome = attack(
        view,
        transcripts(federation, view, ("bob",)),
        TARGET,
        oracle=oracle,
        secret_context=federation.secret,
    )
    assert outcome.read_exactly
    assert np.array_equal(outcome.guess, federation.plain[TARGET])


def test_the_custodian_releases_only_the_logged_sum(
    scenario: tuple[Federation, AggregatorView, Any],
) -> None:
    """The limit of every summation: the released sum minus n - 1 known updates is the
    last one.  The custodian releases exactly this sum and no other of the round."""
    federation, view, oracle = scenario
    release = oracle(sorted(view.offer.contributors), list(view.ciphertexts.values()))
    total = np.frombuffer(release.plaintext, dtype="<i8")
    others = sum(federation.plain[m] for m in MEMBERS if m != TARGET)
    assert np.array_equal(total - others, federation.plain[TARGET])
