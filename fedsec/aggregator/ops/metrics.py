"""The aggregator's Prometheus metrics, through ``prometheus_client``.

Counters and histograms are fed by the round engine's events
(:mod:`fedsec.aggregator.rounds.events`) and by the HTTP layer (requests, bytes); like
every Prometheus counter they start at zero with the process.  What describes the
federation now (round, stage, members, the latest model's scores, ε, open alerts) is
read at scrape time by a collector from values kept current by the same events, so a
scrape costs the same whether the state holds ten rounds or ten thousand.

Each application has its own registry (:attr:`FederationMetrics.registry`), so two
aggregators in one process (the tests, ``fedsec simulate``) never mix their numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fedsec.aggregator.ops.live import LiveView
from fedsec.aggregator.rounds.events import (
    AlertRaised,
    CohortFixed,
    ContributionAccepted,
    ContributionRefused,
    Event,
    RoundEnded,
    RoundOpened,
    StageEntered,
)
from fedsec.protocol.stages import STAGES

# The *_created series (each counter's creation time) double the exposition and say only
# when this process started, which process_start_time_seconds-style tooling knows anyway.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: The content type of :meth:`FederationMetrics.exposition`.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Stage and round durations range from sub-second loopback rounds to the default
# ten-minute training window; aggregation from milliseconds to a minute at 1M parameters.
_DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_AGGREGATION_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class FederationMetrics:
    """Every metric of one aggregator process.

    Args:
        live: the scrape-time view (kept current by its own listener); None for a group
            server (:mod:`fedsec.aggregator.groups`), which counts its own requests and
            contributions but leaves the federation's state to the leader's scrape, so a
            sum over every process counts each request once and each gauge once.
        member_labels: export per-member ε series (``metrics.member_labels``).
    """

    def __init__(self, live: LiveView | None, *, member_labels: bool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.live = live
        self._declare_rounds(self.registry)
        self._declare_contributions(self.registry)
        self._declare_http(self.registry)
        self._declare_operations(self.registry)
        if live is not None:
            self.registry.register(_StateCollector(live, member_labels))

    def _declare_rounds(self, r: CollectorRegistry) -> None:
        """Attempts opened, closed and aborted, and how long stages and rounds last."""
        self.rounds_opened = Counter("fedsec_rounds_opened", "Round attempts opened", registry=r)
        self.rounds_closed = Counter(
            "fedsec_rounds_closed", "Round attempts closed with a new model version", registry=r
        )
        self.rounds_aborted = Counter(
            "fedsec_rounds_aborted",
            "Round attempts aborted, by error code and the stage they ended in",
            ["reason", "stage"],
            registry=r,
        )
        self.stage_seconds = Histogram(
            "fedsec_stage_duration_seconds",
            "How long each stage of an attempt lasted",
            ["stage"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "fedsec_round_duration_seconds",
            "From an attempt's opening to its close (closed attempts)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.aggregation_seconds = Histogram(
            "fedsec_aggregation_seconds",
            "Unmasking, summing and applying one attempt's updates",
            buckets=_AGGREGATION_BUCKETS,
            registry=r,
        )

    def _declare_contributions(self, r: CollectorRegistry) -> None:
        """Contributions accepted and refused, members joined and dropped, wrapped sums."""
        self.accepted = Counter(
            "fedsec_contributions_accepted", "Contributions (masked inputs) accepted", registry=r
        )
        self.refused = Counter(
            "fedsec_contributions_refused",
            "Contributions (masked inputs) refused, by error code",
            ["code"],
            registry=r,
        )
        self.joined = Counter(
            "fedsec_members_joined", "Members in fixed cohorts, summed over attempts", registry=r
        )
        self.dropped = Counter(
            "fedsec_members_dropped",
            "Cohort members whose input is not in their attempt's sum, summed over attempts",
            registry=r,
        )
        # Distributed DP: a coordinate at the ring's edge likely wrapped modulo the ring,
        # which corrupts it in the aggregate; the ratio of the two is the wrap rate.
        self.ddp_wrapped = Counter(
            "fedsec_ddp_wrapped_coordinates",
            "Coordinates of closed sums that can wrap (distributed DP, fewer codec headroom "
            "bits) at the ring's edge (likely wrapped)",
            registry=r,
        )
        self.ddp_summed = Counter(
            "fedsec_ddp_summed_coordinates",
            "Coordinates of closed sums that can wrap (distributed DP, fewer codec headroom bits)",
            registry=r,
        )

    def _declare_http(self, r: CollectorRegistry) -> None:
        """Requests answered and the bytes they carried, by endpoint."""
        self.requests = Counter(
            "fedsec_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.bytes_in = Counter(
            "fedsec_http_request_bytes", "Request body bytes, by endpoint", ["endpoint"], registry=r
        )
        self.head_bytes_in = Counter(
            "fedsec_http_request_head_bytes",
            "Request head bytes (request line and header fields, signature fields "
            "included), by endpoint",
            ["endpoint"],
            registry=r,
        )
        self.bytes_out = Counter(
            "fedsec_http_response_bytes",
            "Response body bytes, by endpoint",
            ["endpoint"],
            registry=r,
        )
        # Each request's series, resolved once: a labels() look-up costs ~1 µs and every
        # request makes up to four.  A child is cached the first time its series is
        # counted, as labels() would create it, so /metrics shows the same series at the
        # same moments.  The keys are the series themselves (endpoint names from the route
        # table or "unmatched", and the statuses the server answers), so the caches are
        # no larger than the counters, and no client can grow them.
        self._request_series: dict[tuple[str, int], Counter] = {}
        self._head_series: dict[str, Counter] = {}
        self._in_series: dict[str, Counter] = {}
        self._out_series: dict[str, Counter] = {}

    def _declare_operations(self, r: CollectorRegistry) -> None:
        """Alerts raised and the live dashboard's pushes."""
        self.alerts = Counter(
            "fedsec_alerts_raised", "Operator alerts raised, by kind", ["kind"], registry=r
        )
        self.dashboard_pushes = Counter(
            "fedsec_dashboard_pushes", "Live snapshots pushed to open dashboards", registry=r
        )
        self.dashboard_seconds = Counter(
            "fedsec_dashboard_push_seconds",
            "Time spent building and writing live dashboard snapshots",
            registry=r,
        )

    def on_event(self, event: Event) -> None:
        """The event-bus listener."""
        match event:
            case RoundOpened():
                self.rounds_opened.inc()
            case StageEntered(previous=previous, previous_s=lasted):
                self.stage_seconds.labels(previous).observe(max(lasted, 0.0))
            case CohortFixed(members=members):
                self.joined.inc(len(members))
            case ContributionAccepted():
                self.accepted.inc()
            case ContributionRefused(code=code):
                self.refused.labels(code).inc()
            case RoundEnded(summary=s, last_stage=stage, last_stage_s=lasted, reason=reason):
                self.stage_seconds.labels(stage).observe(max(lasted, 0.0))
                self.dropped.inc(event.dropped)
                if s.stage == "closed":
                    self.rounds_closed.inc()
                    if s.duration_s is not None:
                        self.round_seconds.observe(max(s.duration_s, 0.0))
                    if s.aggregation_s is not None:
                        self.aggregation_seconds.observe(s.aggregation_s)
                    if s.coordinates:
                        self.ddp_summed.inc(s.coordinates)
                        self.ddp_wrapped.inc(s.edge_count)
                else:
                    self.rounds_aborted.labels(reason or "aborted", stage).inc()
            case AlertRaised(alert=alert):
                self.alerts.labels(alert.kind).inc()
            case _:
                pass

    def observe_request(
        self, endpoint: str, status: int, received: int, sent: int, head: int = 0
    ) -> None:
        """Count one answered request (every one, refused ones included); ``received``
        and ``sent`` are body bytes, ``head`` the request's line and header fields."""
        series = self._request_series.get((endpoint, status))
        if series is None:
            series = self._request_series[endpoint, status] = self.requests.labels(
                endpoint, str(status)
            )
        series.inc()
        if head:
            _child(self._head_series, self.head_bytes_in, endpoint).inc(head)
        if received:
            _child(self._in_series, self.bytes_in, endpoint).inc(received)
        if sent:
            _child(self._out_series, self.bytes_out, endpoint).inc(sent)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """The federation now, read at scrape time."""

    def __init__(self, live: LiveView, member_labels: bool) -> None:
        self._live = live
        self._member_labels = member_labels

    def describe(self) -> Iterator[Metric]:
        return iter(())  # gauges appear and disappear with the state: never pre-declared

    def collect(self) -> Iterator[Metric]:
        yield from self._progress()
        yield from self._members()
        yield from self._model()
        yield from self._privacy()
        yield from self._leadership()
        yield _labelled(
            "fedsec_alerts_open", "Unacknowledged alerts, by kind", "kind", self._live.open_alerts()
        )

    def _progress(self) -> Iterator[Metric]:
        """The round, attempt and stage in progress, and the rounds completed."""
        round_, attempt, stage, completed, version, left = self._live.attempt()
        yield _gauge("fedsec_round", "The round in progress", round_)
        yield _gauge("fedsec_round_attempt", "The attempt of the round in progress", attempt)
        stages = GaugeMetricFamily(
            "fedsec_round_stage", "1 for the stage the attempt in progress is in", labels=["stage"]
        )
        for name in STAGES:  # in the protocol's order, not sorted
            stages.add_metric([name], 1.0 if name == stage else 0.0)
        yield stages
        if left is not None:
            yield _gauge(
                "fedsec_stage_deadline_seconds",
                "Seconds until the stage closes at the latest",
                left,
            )
        yield _gauge("fedsec_rounds_completed", "Rounds closed with a new model", completed)
        yield _gauge("fedsec_model_version", "The model version served", version)

    def _members(self) -> Iterator[Metric]:
        """Active members, and who joined and dropped in the latest attempt."""
        live = self._live
        yield _gauge("fedsec_members_active", "Active agents in the roster", live.active_members())
        yield _gauge(
            "fedsec_round_members_joined", "Members in the latest fixed cohort", live.joined
        )
        yield _gauge(
            "fedsec_round_members_dropped",
            "Cohort members left out of the latest ended attempt",
            live.dropped,
        )

    def _model(self) -> Iterator[Metric]:
        """The newest scored model's metrics, once there are some: each by name, the
        task's primary metric by name and direction, and (classification) accuracy and
        the loss under their own names."""
        live = self._live
        if live.metrics:
            yield _labelled(
                "fedsec_model_metric",
                "The task's metrics (and its loss) of the newest scored model, by name",
                "metric",
                live.metrics,
            )
        if live.federated and live.evaluators:
            yield _gauge(
                "fedsec_model_evaluation_members",
                "Members whose signed evaluation reports the newest model's metrics pool "
                "(validation.federated)",
                live.evaluators,
            )
        if live.primary_metric in live.metrics:
            primary = GaugeMetricFamily(
                "fedsec_model_primary_metric",
                "The task's primary metric of the newest scored model (what the "
                "validation_degraded alert follows), with its name and direction",
                labels=["metric", "higher_is_better"],
            )
            primary.add_metric(
                [live.primary_metric, str(live.higher_is_better).lower()],
                live.metrics[live.primary_metric],
            )
            yield primary
        if live.accuracy is not None:
            yield _gauge(
                "fedsec_model_validation_accuracy",
                "Validation accuracy of the newest scored model",
                live.accuracy,
            )
        if live.loss is not None:
            yield _gauge(
                "fedsec_model_validation_loss",
                "Validation loss of the newest scored model",
                live.loss,
            )

    def _leadership(self) -> Iterator[Metric]:
        """Whether this process may write (1 when it leads or is alone), and among
        replicas its fencing token and the writes the fence refused it."""
        role = self._live.leadership()
        yield _gauge(
            "fedsec_leader",
            "1 when this aggregator leads (or runs alone), 0 on a standby",
            1.0 if role.role != "standby" else 0.0,
        )
        if role.role != "single":
            yield _gauge(
                "fedsec_fencing_token",
                "The fencing token this aggregator writes under (0 on a standby)",
                role.token or 0,
            )
            yield _gauge(
                "fedsec_fenced_writes_refused",
                "Writes of this aggregator the leader lease refused since it started",
                role.fenced,
            )

    def _privacy(self) -> Iterator[Metric]:
        """The largest ε reported, and each member's where member labels are on."""
        live = self._live
        if live.epsilon:
            yield _gauge(
                "fedsec_epsilon_max",
                "The largest privacy spend (epsilon) any member reported",
                max(live.epsilon.values()),
            )
            if self._member_labels:
                yield _labelled(
                    "fedsec_member_epsilon",
                    "The largest epsilon each member reported",
                    "member",
                    live.epsilon,
                )


def _child(cache: dict[str, Counter], counter: Counter, label: str) -> Counter:
    """``counter.labels(label)`` (a child, typed as its counter), looked up in ``cache``
    first (see ``_declare_http``)."""
    found = cache.get(label)
    if found is None:
        found = cache[label] = counter.labels(label)
    return found


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


def _labelled(
    name: str, documentation: str, label: str, values: Mapping[str, float]
) -> GaugeMetricFamily:
    """One gauge per key of ``values``, labelled ``label``, in key order (sorted, so a
    scrape's order is stable)."""
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], float(value))
    return family
