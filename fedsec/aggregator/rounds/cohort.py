"""Forming an attempt's cohort: joins, staleness (buffered mode), when the cohort is
fixed, and the signed :class:`~fedsec.protocol.wire.RoundSpec` that fixes it."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import msgspec

from fedsec.aggregator.rounds.attempt import Attempt
from fedsec.aggregator.rounds.context import RoundContext, log
from fedsec.aggregator.rounds.data_summaries import DataSummaryDesk
from fedsec.aggregator.rounds.he_context import HeContextDesk
from fedsec.config import AggregationSection, CodecSection, DPSection
from fedsec.errors import PayloadError, StaleUpdate, TaskDigestMismatch, TaskMismatch
from fedsec.protocol import wire
from fedsec.protocol.ring_width import ring_bits_for
from fedsec.protocol.shards import ShardGroup, group_url
from fedsec.summation import mode_named
from fedsec.summation.sharded import shard_groups
from fedsec.task.digest import check_pin


@dataclass
class _JoinTally:
    """The joins of the attempt in stage open, as far as readiness asks: how many, and
    when the ``min_agents``-th joined (the join window's start).

    Asked after every join and at every tick: counting the store's rows was O(n) and
    finding the n-th by time O(n log n) per ask (0.17 ms a join at 1,000 members, O(n^2)
    a round).  Read from the store once per attempt, then kept as joins are recorded
    (this desk records every join; a new process reads the store again).
    """

    round: int
    attempt: int
    count: int
    window_start: float | None = None  # None: not read (yet)


class CohortDesk:
    """Who is in an attempt's cohort, and what the cohort trains and sums by."""

    def __init__(self, ctx: RoundContext, he: HeContextDesk) -> None:
        self._ctx = ctx
        self._he = he
        self.summaries = DataSummaryDesk(ctx)
        self._mode = mode_named(ctx.cfg.round.secure_sum)
        # (round, attempt) whose "not fixing the cohort" reason was logged already
        self._waiting_logged: set[tuple[int, int, str]] = set()
        self._tally: _JoinTally | None = None

    @property
    def cap(self) -> int:
        """Members per cohort: max_agents, or the buffer size K in buffered mode; no more
        than the mode's sum holds (homomorphic summation: the CKKS headroom)."""
        r = self._ctx.cfg.round
        cap = min(r.max_agents, r.buffer_size) if self._ctx.buffered else r.max_agents
        capacity = self._mode.capacity(self._ctx.cfg)
        return cap if capacity is None else min(cap, capacity)

    def join(
        self, live: Attempt, member: str, req: wire.JoinRequest
    ) -> tuple[wire.JoinResponse, bool]:
        """Record ``member``'s join of ``live`` (in stage open).

        Returns:
            The answer, and whether the join was recorded just now.

        Raises:
            TaskMismatch: another task version or data schema; with a federation schema,
                a missing summary or data that differs (:class:`DataSummaryDesk`).
            SignatureError: a data summary not signed by the member.
            PayloadError, StaleUpdate: see :meth:`_check_staleness`; no samples.
            TaskDigestMismatch: the member's installed task package is not the one
                installed here (each differing field named), or it sent no pin.
        """
        self._check_task(member, req)
        if self._ctx.buffered:
            self._check_staleness(member, req.base_version)
        state = self._ctx.ws.state
        # count and look up, not read every join: this runs once per member (O(n^2) at
        # 1,000 members when it read them all)
        if state.joins.joined(live.round, live.attempt, member):
            return wire.JoinResponse(accepted=True, detail="already joined"), False
        tally = self._joins(live)
        if tally.count >= self.cap:
            full = "cohort is full; try the next round"
            return wire.JoinResponse(accepted=False, detail=full), False
        graph = self._mode.commits_graph
        if graph and not req.graph_commitment:
            raise PayloadError(
                f"{member} sent no graph commitment: a SecAgg+ member commits to its share "
                "of the neighbour graph's randomness when it joins"
            )
        now = self._ctx.clock()
        state.joins.add(
            live.round,
            live.attempt,
            member,
            req.samples,
            now,
            req.base_version,
            req.graph_commitment if graph else "",
        )
        tally.count += 1
        if tally.window_start is not None and now < tally.window_start:
            tally.window_start = None  # the clock went back: the n-th by time may differ
        self.summaries.record(member, req.data_summary)
        return wire.JoinResponse(accepted=True, detail="joined"), True

    def _check_task(self, member: str, req: wire.JoinRequest) -> None:
        """``member`` trains the federation's task, on data of its schema, and has some.

        Raises:
            TaskMismatch, TaskDigestMismatch, SignatureError, PayloadError: as
                :meth:`join` says.
        """
        self._check_pin(member, req.task_pin)
        task = self._ctx.task
        if req.task_version != task.version:
            raise TaskMismatch(
                f"{member} runs task {task.name} version {req.task_version}, the federation "
                f"requires version {task.version}"
            )
        self.summaries.check(member, req.data_summary)
        if req.dataset_schema != task.schema.fingerprint():
            raise TaskMismatch(
                f"{member}'s data schema {req.dataset_schema[:16]}… differs from the federation's "
                f"{task.schema.fingerprint()[:16]}… (features or classes differ)"
            )
        if req.samples < 1:
            raise PayloadError(f"{member} reports {req.samples} samples; need at least 1")

    def _check_pin(self, member: str, pin: wire.TaskPin | None) -> None:
        """The member runs the task package this aggregator runs: the one every spec pins.

        A member states its pin itself, so this catches a misinstalled member before it
        takes a cohort seat; an honest member also checks the signed spec's pin before
        it trains (``fedsec.agent.spec.check_spec_task``).

        Raises:
            TaskDigestMismatch: no pin, or one that differs (each differing field named).
        """
        if pin is None:
            raise TaskDigestMismatch(
                f"{member} sent no task pin: this federation pins the task package "
                f"{self._ctx.task_pin.distribution} {self._ctx.task_pin.version}; "
                "upgrade the agent so that it states the package it installed"
            )
        check_pin(self._ctx.task_pin, pin, member)

    def _check_staleness(self, member: str, base: int | None) -> None:
        """Buffered mode: τ = current version − base version must be within max_staleness.

        Raises:
            PayloadError: no base version, or one from the future.
            StaleUpdate: τ > max_staleness (409).
        """
        current = self._ctx.ws.models.latest().version
        limit = self._ctx.cfg.round.max_staleness
        if base is None or base > current or base < 1:
            raise PayloadError(
                f"{member}: buffered rounds need the model version the update was trained on "
                f"(1..{current}), got {base}"
            )
        tau = current - base
        if tau > limit:
            raise StaleUpdate(
                f"{member}'s update was trained on version {base}, {tau} versions behind the "
                f"current {current}; the federation accepts at most {limit}: train on the "
                "newest model"
            )

    def ready(self, live: Attempt, now: float) -> bool:
        """True when the cohort is to be fixed: every active member joined, the cohort is
        full, or the join window (``advertise_s``, counted from the ``min_agents``-th
        join) passed."""
        cfg, ws = self._ctx.cfg.round, self._ctx.ws
        if not self._mode_ready(live):
            return False
        # asked after every join and at every tick: count first (kept, O(1)), read the
        # joins only once as many have joined as are active (reading them all each time
        # was O(n^2))
        joined = self._joins(live).count
        if joined < cfg.min_agents:
            return False
        if joined >= self.cap or now >= self.join_deadline(live):
            return True
        # O(1) first: fewer joins than the active members less the quarantined ones (a
        # lower bound of those expected) means one is still missing
        if joined < ws.roster.active_agent_count() - len(self._ctx.quarantined):
            return False
        active = {e.agent_id for e in ws.roster.active_agents()} - self._ctx.quarantined.keys()
        if joined < len(active):
            return False
        return active <= ws.state.joins.samples(live.round, live.attempt).keys()

    def _mode_ready(self, live: Attempt) -> bool:
        """Where a custodian decrypts, the cohort is fixed only once it published the
        context; and only if the mode's sum holds ``min_agents`` (the CKKS headroom);
        else it stays open (the reason logged once per attempt; the headroom also alerts
        the operator)."""
        if self._mode.custodian_decrypts and not self._he.sha256:
            self._waiting(live, "waiting_for_he_context", "")
            return False
        capacity, need = self._mode.capacity(self._ctx.cfg), self._ctx.cfg.round.min_agents
        if capacity is not None and capacity < need:
            detail = (
                f"CKKS at [he] scale_bits holds sums of at most {capacity} members at "
                f"quant_bits {self._ctx.cfg.round.quant_bits}, fewer than min_agents {need}: "
                "no cohort can be fixed; lower round.quant_bits or he.scale_bits"
            )
            if self._waiting(live, "he_headroom_exceeded", detail):
                self._ctx.alert("round_stalled", f"round {live.round}.{live.attempt}", detail)
            return False
        return True

    def _waiting(self, live: Attempt, event: str, detail: str) -> bool:
        """Log ``event`` for ``live`` once; True the first time."""
        key = (live.round, live.attempt, event)
        if key in self._waiting_logged:
            return False
        self._waiting_logged.add(key)
        log.log(
            logging.WARNING if detail else logging.INFO,
            "event=%s round=%d attempt=%d detail=%r",
            event,
            live.round,
            live.attempt,
            detail,
        )
        return True

    def join_deadline(self, live: Attempt) -> float:
        """When the join window closes (``advertise_s`` after the ``min_agents``-th
        join), fixing the cohort at the latest; +inf until that many joined."""
        cfg = self._ctx.cfg.round
        tally = self._joins(live)
        if tally.count < cfg.min_agents:
            return math.inf
        if tally.window_start is None:  # read once: later joins come after it
            tally.window_start = self._ctx.ws.state.joins.nth_time(
                live.round, live.attempt, cfg.min_agents
            )
        return tally.window_start + cfg.advertise_s

    def _joins(self, live: Attempt) -> _JoinTally:
        """``live``'s join tally, read from the store on its first use."""
        tally = self._tally
        if tally is None or (tally.round, tally.attempt) != (live.round, live.attempt):
            count = self._ctx.ws.state.joins.count(live.round, live.attempt)
            tally = self._tally = _JoinTally(live.round, live.attempt, count)
        return tally

    def fixed_spec(self, live: Attempt) -> wire.RoundSpec:
        """The signed spec fixing the cohort: the first to join, by arrival."""
        state = self._ctx.ws.state
        cohort = sorted(list(state.joins.samples(live.round, live.attempt))[: self.cap])
        staleness: dict[str, int] = {}
        if self._ctx.buffered:
            current = self._ctx.ws.models.latest().version
            bases = state.joins.bases(live.round, live.attempt)
            staleness = {m: current - (bases.get(m) or current) for m in cohort}
        return self.build_spec(live, cohort, staleness)

    def _graph_commitments(self, live: Attempt, cohort: list[str]) -> list[str]:
        """SecAgg+: the cohort's graph commitments, in cohort order (none otherwise)."""
        if not self._mode.commits_graph or not cohort:
            return []
        joined = self._ctx.ws.state.joins.commitments(live.round, live.attempt)
        return [joined[m] for m in cohort]

    def roster_keys(self, cohort: list[str]) -> dict[str, bytes]:
        """Member id -> Ed25519 public key, for the members of ``cohort`` on the roster."""
        keys = {}
        for member in cohort:
            entry = self._ctx.ws.roster.get(member)
            if entry is not None:
                keys[member] = entry.public_key_bytes
        return keys

    def _weight_caps(self, cohort: list[str]) -> dict[str, float]:
        caps = {}
        for m in cohort:
            entry = self._ctx.ws.roster.get(m)
            if entry is not None and entry.max_weight is not None:
                caps[m] = float(entry.max_weight)
        return caps

    def build_spec(
        self, live: Attempt, cohort: list[str], staleness: dict[str, int]
    ) -> wire.RoundSpec:
        """The signed spec of this attempt (with an empty cohort: the buffered-mode plan)."""
        ctx, cfg = self._ctx, self._ctx.cfg
        mode = self._mode
        k, t = mode.graph(len(cohort), cfg.round)
        manifest = ctx.ws.models.latest()
        he = mode.custodian_decrypts
        seed = os.urandom(32).hex()
        groups = [
            ShardGroup(g, *mode.graph(len(g), cfg.round), group_url(cfg.round.group_servers, i))
            for i, g in enumerate(shard_groups(cohort, seed, cfg.round.shards))
        ]
        # each group's sum is revealed: with distributed DP, the noise is sized for the
        # survivors of the smallest group, so that every group's sum carries all of it
        noise_members = min((len(g.members) for g in groups), default=len(cohort))
        return wire.RoundSpec(
            federation_id=ctx.ws.federation_id,
            round=live.round,
            attempt=live.attempt,
            secure_sum=cfg.round.secure_sum,
            model_version=manifest.version,
            model_sha256=manifest.sha256,
            task=ctx.task.name,
            task_version=ctx.task.version,
            schema_fingerprint=ctx.task.schema.fingerprint(),
            cohort=cohort,
            neighbors=k,
            threshold=t,
            quant_bits=cfg.round.quant_bits,
            ring_bits=ring_bits_for(
                cfg.round.quant_bits, max(len(cohort), 1), cfg.codec.headroom_bits
            ),
            clip_norm=cfg.round.clip_norm,
            dim=ctx.dim,
            seed=seed,
            max_weight_samples=cfg.round.max_weight_samples,
            weight_caps=self._weight_caps(cohort),
            training=wire.TrainingSpec(
                local_epochs=cfg.training.local_epochs,
                batch_size=cfg.training.batch_size,
                lr=cfg.training.lr,
                optimizer=cfg.training.optimizer,
            ),
            dp=_dp_spec(cfg.dp, noise_members),
            deadlines=mode.spec_deadlines(cfg.round),
            mode=cfg.round.mode,
            staleness=staleness,
            he_context_sha256=self._he.sha256 if he else "",
            custodian=self._he.custodian if he else "",
            he_model_hidden=he and not cfg.he.model_visible_to_aggregator,
            graph_commitments=self._graph_commitments(live, cohort),
            aggregation=_aggregation_spec(cfg.aggregation),
            codec=_codec_spec(cfg.codec),
            task_pin=ctx.task_pin,
            federated_evaluation=cfg.validation.federated,
            groups=groups,
        ).sign(ctx.ws.signer)


def _codec_spec(section: CodecSection) -> wire.CodecSpec:
    """The spec's codec; the plain pipeline as ``wire.PLAIN_CODEC`` itself, so specs
    without compression keep the fields, and the signatures, they had before."""
    codec = section.spec()
    return wire.PLAIN_CODEC if codec == wire.PLAIN_CODEC else codec


def _dp_spec(section: DPSection, cohort: int) -> wire.DPSpec:
    """The spec's DP settings; distributed DP sizes the noise for the fewest survivors
    the round may close with (the session aborts before unmasking fewer)."""
    distributed = section.mode == "distributed"
    return wire.DPSpec(
        enabled=section.enabled,
        noise_multiplier=section.noise_multiplier,
        max_grad_norm=section.max_grad_norm,
        delta=section.delta,
        mode=section.mode,
        sample_rate=section.sample_rate if distributed and section.unit == "record" else 0.0,
        min_survivors=(
            max(1, math.ceil(section.min_survivors_fraction * cohort)) if distributed else 0
        ),
        unit=section.unit if distributed else "record",
    )


def _aggregation_spec(section: AggregationSection) -> wire.AggregationSpec | None:
    """The spec's rule: None for the default (plain FedAvg), so such specs keep the
    fields, and the signatures, they had before rules existed."""
    if section == AggregationSection():
        return None
    return wire.AggregationSpec(**msgspec.structs.asdict(section))
