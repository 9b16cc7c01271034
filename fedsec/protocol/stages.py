"""The stages of a round attempt: the one set of names every layer uses.

An attempt starts in ``open`` (the cohort forms), passes through its summation mode's
message stages, in the mode's order (``SummationMode.stages`` in
:mod:`fedsec.summation`, which also gives each its deadline), and ends ``closed``
(aggregated, a new model version written) or ``aborted`` (too few members remain;
another attempt of the same round follows).  The SecAgg+ message stages are the crypto
server's own (:class:`ServerStage`); a homomorphic-summation round passes through
``commit`` (each member's signed hash of the ciphertext it will send), ``masked_input``
(ciphertexts) and ``decrypt`` (the key custodian's decryption of their sum).

:data:`STAGES` orders every stage of every mode in one list: the order the existing
modes keep, and the one a stage a mode does not pass through is placed by.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from fedsec.crypto.secagg.server import ServerStage

Stage = Literal[
    "open",  # cohort forming: agents join
    "advertise",  # cohort fixed, spec signed: agents train, then advertise keys
    "share_keys",
    "commit",  # homomorphic summation: members commit to their ciphertexts' hashes
    "masked_input",
    "consistency",  # SecAgg+: survivors sign the survivor sets before any unmasking
    "unmask",
    "decrypt",  # homomorphic summation: the key custodian decrypts the sum of ciphertexts
    "closed",  # aggregated: new model version written
    "aborted",  # too few members; a new attempt follows
]
#: Every stage, in the order an attempt passes through them (``aborted`` ends it early).
STAGES: Final[tuple[Stage, ...]] = get_args(Stage)
#: The stages in which members send SecAgg+ messages, in order.
SECAGG_STAGES: Final[tuple[Stage, ...]] = tuple(
    s for s in STAGES if s in {m.value for m in ServerStage}
)
#: The SecAgg+ key-agreement stages, which a round without secure summation skips.
KEY_STAGES: Final[tuple[Stage, ...]] = SECAGG_STAGES[:2]
#: The stages of a homomorphic-summation attempt after open: members commit to their
#: ciphertexts' hashes (so none is built from another's), upload the ciphertexts, then
#: the key custodian decrypts their sum.
HE_STAGES: Final[tuple[Stage, ...]] = ("commit", "masked_input", "decrypt")
#: The stages an attempt may be in while it still accepts messages, in order.
ACTIVE_STAGES: Final[tuple[Stage, ...]] = tuple(
    s for s in STAGES if s == "open" or s in SECAGG_STAGES or s in HE_STAGES
)
#: The stages that end an attempt.
FINAL_STAGES: Final[tuple[Stage, ...]] = ("closed", "aborted")


def stage_index(stage: str) -> int:
    """Position of ``stage`` in :data:`STAGES`, to tell "not yet" from "already past".

    Raises:
        ValueError: not a stage.
    """
    try:
        return STAGES.index(stage)  # type: ignore[arg-type,unused-ignore]
    except ValueError:
        raise ValueError(f"unknown stage {stage!r}") from None
