"""A member's quality weight: volume × the quality of its signed data summary, capped
by the roster; one definition for the member that applies it and the auditor."""

from __future__ import annotations

import math

import msgspec
import pytest

from fedsec.protocol.data_schema import ObservedSchema
from fedsec.protocol.weights import contribution_weight, quality_factor, volume_weight
from fedsec.protocol.wire import DataSummary, RoundSpec


class _Spec(msgspec.Struct, frozen=True):
    """The two fields the weight reads of a RoundSpec."""

    max_weight_samples: int
    weight_caps: dict[str, float]


def _spec(**caps: float) -> RoundSpec:
    return _Spec(max_weight_samples=1000, weight_caps=caps)  # type: ignore[return-value]


def _summary(quality: float) -> DataSummary:
    return DataSummary(
        federation_id="f",
        member="m",
        records=800,
        label_counts={"0": 400, "1": 400},
        missing_rate={},
        schema_fingerprint="ab" * 32,
        observed=ObservedSchema(label="y", classes=["0", "1"], columns=[]),
        label_coverage=1.0,
        quality_score=quality,
    )


def test_volume_alone_without_a_summary() -> None:
    assert contribution_weight(250, _spec(), "m") == 0.25
    assert contribution_weight(5000, _spec(), "m") == 1.0  # volume saturates at 1
    assert volume_weight(250, _spec(), "m") == 0.25
    assert quality_factor(None) == 1.0


@pytest.mark.parametrize(
    ("quality", "expected"), [(0.5, 0.5), (1.7, 1.0), (-0.2, 0.0), (math.nan, 0.0)]
)
def test_quality_is_clamped_to_zero_one(quality: float, expected: float) -> None:
    assert quality_factor(_summary(quality)) == expected


def test_quality_scales_volume_and_the_roster_cap_bounds_both() -> None:
    half = _summary(0.5)
    assert contribution_weight(800, _spec(), "m", half) == pytest.approx(0.4)
    # the roster's max weight caps the product, never raises it
    assert contribution_weight(800, _spec(m=0.3), "m", half) == pytest.approx(0.3)
    assert contribution_weight(800, _spec(m=0.9), "m", half) == pytest.approx(0.4)
    # the volume weight is what the quality weight may never exceed
    assert contribution_weight(800, _spec(), "m", half) <= volume_weight(800, _spec(), "m")
