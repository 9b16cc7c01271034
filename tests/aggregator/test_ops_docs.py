"""The operator's documents name everything the aggregator can raise or export: every
alert kind in docs/runbook.md and docs/monitoring.md, every metric family in
docs/monitoring.md, so an operator paged by an alert or reading a dashboard panel finds
what it means and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsec.aggregator.ops.live import LiveView
from fedsec.aggregator.ops.metrics import FederationMetrics
from fedsec.aggregator.rounds.alerts import ALERT_KINDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("doc", ["runbook.md", "monitoring.md"])
def test_every_alert_kind_is_documented(doc: str) -> None:
    text = (DOCS / doc).read_text(encoding="utf-8")
    missing = [kind for kind in ALERT_KINDS if f"`{kind}`" not in text]
    assert not missing, f"docs/{doc} does not describe alert kind(s) {missing}"


def _exposed_names() -> list[str]:
    """Every metric family name as a scrape shows it (counters with ``_total``)."""
    live = LiveView(lambda: (1, 0, "open", 0, 0, 5.0), lambda: 0, lambda: {"round_stalled": 1})
    # Gauges that exist only once there is something to say (a deadline, a scored model,
    # a privacy report) are collected only when their value is known: give them one.
    live.accuracy, live.loss, live.epsilon = 0.9, 0.3, {"member-a": 1.0}
    live.metrics = {"accuracy": 0.9, "loss": 0.3}
    live.federated, live.evaluators = True, 3
    metrics = FederationMetrics(live, member_labels=True)
    names = []
    for family in metrics.registry.collect():
        # prometheus_client names a counter family without the _total its samples carry
        names.append(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_every_metric_is_documented() -> None:
    text = (DOCS / "monitoring.md").read_text(encoding="utf-8")
    names = _exposed_names()
    assert "fedsec_rounds_opened_total" in names  # the counter suffix rule still holds
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/monitoring.md does not list metric(s) {missing}"
