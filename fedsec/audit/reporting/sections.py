"""The sections of the audit report's page, each HTML from the gathered summary.

Every string taken from the log or from the verdicts file is HTML-escaped.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fedsec.audit.reporting.charts import bar_chart, line_chart
from fedsec.audit.reporting.markup import escape as _e
from fedsec.audit.reporting.markup import fmt as _fmt
from fedsec.audit.reporting.markup import key_cell as _key_cell
from fedsec.audit.reporting.markup import kv as _kv
from fedsec.audit.reporting.markup import when as _when
from fedsec.audit.reporting.summary import LogSummary, RoundRow
from fedsec.audit.reporting.summary import num as _num
from fedsec.audit.verify import VerifyResult


def verification_section(result: VerifyResult, inputs: dict[str, str]) -> str:
    if result.ok:
        banner = (
            '<div class="verdict ok"><b>VERIFIED</b>every check holds: chain, signed heads, '
            "roster and signatures, archived messages, re-aggregation, model re-derivation, "
            "privacy reports and receipts.</div>"
        )
    else:
        banner = (
            f'<div class="verdict failed"><b>FAILED</b>{_e(result.problem)}</div>'
            '<div class="warn">Verification stopped at the first problem. The figures below '
            "are read from the log as it stands and are <b>not vouched for</b>.</div>"
        )
    counts = _kv(
        [
            ("entries checked", str(result.entries)),
            ("signed heads verified", str(result.heads)),
            ("rounds re-aggregated", str(result.rounds_verified)),
            ("model versions re-derived", str(result.models_verified)),
            ("privacy reports checked", str(result.privacy_reports)),
            ("receipts checked", str(result.receipts_checked)),
            *((k, _e(v)) for k, v in inputs.items()),
        ]
    )
    return f'<h2>Verification</h2>{banner}<div class="card">{counts}</div>'


def _federation_rows(s: LogSummary) -> list[tuple[str, str]]:
    """The federation's settings as the genesis entry and the latest spec give them."""
    g = s.genesis
    server = g.server if g is not None else {}
    round_cfg = g.round if g is not None else {}
    dp = s.dp
    training = dp.get("training") if isinstance(dp.get("training"), dict) else None
    rows = [
        ("federation", _e(g.federation_id if g is not None else "–")),
        (
            "task",
            f"{_e(g.task)} (version {_e(g.task_version)})" if g is not None else "– (version –)",
        ),
        (
            "data schema fingerprint",
            f'<span class="mono">{_e(g.schema_fingerprint if g is not None else None)}</span>',
        ),
        ("aggregator key", _key_cell(g.aggregator_public_key if g is not None else None)),
        ("roster admin key", _key_cell(g.admin_public_key if g is not None else None)),
        (
            "server optimiser",
            f"{_e(server.get('optimizer', '–'))}, server learning rate "
            f"{_e(server.get('server_lr', '–'))}",
        ),
        (
            "rounds",
            f"{sum(1 for r in s.rounds.values() if r.status == 'closed')} closed of "
            f"{_e(round_cfg.get('rounds', '–'))} planned; cohort "
            f"{_e(round_cfg.get('min_agents', '–'))}–{_e(round_cfg.get('max_agents', '–'))} "
            f"members; secure summation {_e(round_cfg.get('secure_sum', '–'))}",
        ),
        (
            "differential privacy",
            (
                f"{'enabled' if dp.get('enabled') else 'disabled'}; noise multiplier "
                f"{_e(dp.get('noise_multiplier'))}, clipping norm {_e(dp.get('max_grad_norm'))},"
                f" δ = {_e(dp.get('delta'))}"
            )
            if dp
            else "–",
        ),
        (
            "local training",
            ", ".join(f"{_e(k)} {_e(v)}" for k, v in sorted(training.items())) if training else "–",
        ),
        ("latest model version", _e(s.latest_version if s.latest_version is not None else "–")),
        ("log", f"{s.entries} entries, {_when(s.first_time)} to {_when(s.last_time)}"),
    ]
    if s.unreadable:
        rows.append(("unreadable lines", f"<b>{s.unreadable}</b>"))
    if s.last_head is not None:
        rows.append(
            (
                "last signed head",
                f'entry {s.last_head[0]}, signing <span class="mono">{_e(s.last_head[1])}</span>',
            )
        )
    return rows


def _roster_table(s: LogSummary) -> str:
    roster_rows = "".join(
        f"<tr><td>{_e(m)}</td><td>{_e(b.role)}</td>"
        f'<td><span class="pill p-{_e(b.status)}">{_e(b.status)}</span></td>'
        f"<td>{_key_cell(b.public_key)}</td>"
        f"<td>{_when(_num(b.added_at))}</td></tr>"
        for m, b in sorted(s.roster.items())
    )
    return (
        "<table><tr><th>member</th><th>role</th><th>status</th><th>key</th><th>added</th></tr>"
        f"{roster_rows}</table>"
        if roster_rows
        else "<p>no roster entries</p>"
    )


def federation_section(s: LogSummary) -> str:
    return (
        f'<h2>Federation</h2><div class="card">{_kv(_federation_rows(s))}</div>'
        f'<h2>Roster</h2><div class="card">{_roster_table(s)}</div>'
    )


def _score(row: RoundRow, metric: str) -> float | None:
    """A round's model's value of ``metric`` (manifests written before metrics were named
    hold accuracy only)."""
    return row.metrics.get(metric, row.accuracy if metric == "accuracy" else None)


def rounds_section(rows: list[RoundRow], metric: str = "accuracy") -> str:
    head = (
        "<tr><th class='n'>round</th><th class='n'>attempt</th><th>status</th>"
        "<th class='n'>cohort</th><th class='n'>survivors</th><th>dropped</th>"
        "<th class='n'>accepted</th><th class='n'>refused</th><th class='n'>model version</th>"
        f"<th class='n'>{_e(metric)}</th><th class='n'>ε max</th><th class='n'>duration (s)</th>"
        "<th class='n'>aggregation (s)</th></tr>"
    )
    body = "".join(
        f'<tr id="round-{r.round}-{r.attempt}"><td class="n">{r.round}</td>'
        f'<td class="n">{r.attempt}</td>'
        f'<td><span class="pill p-{_e(r.status)}">{_e(r.status)}</span>'
        f"{'<br>' + _e(r.detail) if r.detail else ''}</td>"
        f'<td class="n">{r.cohort}</td>'
        f'<td class="n">{"–" if r.survivors is None else r.survivors}</td>'
        f"<td>{_e(', '.join(r.dropped)) or '–'}</td>"
        f'<td class="n">{r.accepted}</td><td class="n">{r.refused}</td>'
        f'<td class="n">{"–" if r.model_version is None else r.model_version}</td>'
        f'<td class="n">{_fmt(_score(r, metric), 4)}</td><td class="n">{_fmt(r.epsilon_max)}</td>'
        f'<td class="n">{_fmt(r.duration_s, 2)}</td>'
        f'<td class="n">{_fmt(r.aggregation_s, 3)}</td></tr>'
        for r in rows
    )
    note = (
        '<p class="note">Times come from the log entries: duration is from the signed round '
        "spec (cohort fixed) to the aggregate or abort entry; aggregation is from the last "
        "accepted message to the aggregate entry (unmasking, model update and validation). "
        "Accepted and refused count contributions (masked inputs). ε max is the largest "
        "cumulative ε any member reported in the attempt.</p>"
    )
    if not rows:
        return '<h2>Rounds</h2><div class="card"><p>no rounds</p></div>'
    return f'<h2>Rounds</h2><div class="card"><table>{head}{body}</table>{note}</div>'


def charts_section(s: LogSummary, rows: list[RoundRow]) -> str:
    by_round: dict[int, list[RoundRow]] = defaultdict(list)
    for r in rows:
        by_round[r.round].append(r)
    rounds = sorted(by_round)
    labels = [str(r) for r in rounds]
    final = {r: max(by_round[r], key=lambda x: x.attempt) for r in rounds}
    participants = bar_chart(
        "Participants per round",
        labels,
        [
            ("cohort", [float(final[r].cohort) for r in rounds]),
            ("survivors", [float(final[r].survivors or 0) for r in rounds]),
        ],
        "members",
    )
    contributions = bar_chart(
        "Contributions accepted / refused per round",
        labels,
        [
            ("accepted", [float(sum(x.accepted for x in by_round[r])) for r in rounds]),
            ("refused", [float(sum(x.refused for x in by_round[r])) for r in rounds]),
        ],
        "contributions",
    )
    metric, _ = s.primary_metric()
    share = "accuracy" in metric or metric.endswith("f1")  # a share: drawn on all of [0, 1]
    accuracy = line_chart(
        f"Validation {metric} per round",
        [
            (
                metric,
                [(float(r), a) for r in rounds if (a := _score(final[r], metric)) is not None],
            )
        ],
        metric,
        y_min=0.0 if share else None,
        y_max=1.0 if share else None,  # the whole scale: small changes not drawn as large
    )
    epsilon = line_chart(
        "ε per member over rounds",
        [
            (member, [(float(r), eps) for r, (eps, _, _) in sorted(per_round.items())])
            for member, per_round in sorted(s.epsilon.items())
        ],
        "ε (cumulative)",
        y_min=0.0,
    )
    cards = "".join(f'<div class="card">{c}</div>' for c in (participants, contributions))
    cards += "".join(f'<div class="card">{c}</div>' for c in (accuracy, epsilon))
    return f'<h2>Charts</h2><div class="charts">{cards}</div>'


def privacy_section(s: LogSummary) -> str:
    if not s.epsilon:
        return '<h2>Privacy</h2><div class="card"><p>no privacy reports</p></div>'
    rows = []
    for member, per_round in sorted(s.epsilon.items()):
        last = max(per_round)
        eps, dataset, delta = per_round[last]
        rows.append(
            f"<tr><td>{_e(member)}</td><td>{_e(dataset)}</td><td class='n'>{len(per_round)}</td>"
            f"<td class='n'>{last}</td><td class='n'>{eps:.4f}</td><td class='n'>{delta:g}</td>"
            "</tr>"
        )
    return (
        '<h2>Privacy</h2><div class="card"><table><tr><th>member</th><th>dataset</th>'
        "<th class='n'>rounds reported</th><th class='n'>last round</th>"
        "<th class='n'>ε spent</th><th class='n'>δ</th></tr>"
        f"{''.join(rows)}</table><p class='note'>ε is what each member reported, signed, after "
        "its last round; verification recomputes it from the logged noise, sampling rate and "
        "steps with an independent accountant.</p></div>"
    )


def data_summaries_section(s: LogSummary) -> str:
    """Each member's latest signed data summary: what it declared about its data."""
    if not s.data_summaries:
        return ""
    rows = "".join(
        f"<tr><td>{_e(d.member)}</td><td class='n'>{_e(d.records)}</td>"
        f"<td>{_e(', '.join(f'{k}: {v}' for k, v in d.label_counts.items()))}</td>"
        f"<td class='n'>{_fmt(d.label_coverage)}</td>"
        f"<td class='n'>{_fmt(max(d.missing_rate.values(), default=0.0))}</td>"
        f"<td class='n'>{_fmt(d.quality_score)}</td>"
        f"<td class='n'>{_e(d.count_epsilon or 'exact')}</td>"
        f"<td class='mono'>{_e(d.schema_fingerprint[:16])}</td></tr>"
        for d in sorted(s.data_summaries.values(), key=lambda d: d.member)
    )
    return (
        "<h2>Data summaries</h2><div class='card'><table><tr><th>member</th>"
        "<th class='n'>records</th><th>label counts</th><th class='n'>label coverage</th>"
        "<th class='n'>worst missing rate</th><th class='n'>quality</th>"
        "<th class='n'>count noise ε</th><th>schema</th></tr>"
        f"{rows}</table></div>"
    )


def challenges_section(s: LogSummary, verdicts: list[dict[str, Any]] | None) -> str:
    logged = ""
    if s.challenges:
        items = []
        for c in s.challenges:
            revealed = (c.round, c.attempt, c.member, c.auditor) in s.reveals
            items.append(
                f"<tr><td class='n'>{_e(c.round)}</td><td class='n'>{_e(c.attempt)}"
                f"</td><td>{_e(c.member)}</td><td>{_e(c.auditor)}</td>"
                f"<td class='n'>{_e(c.rate)}</td><td class='n'>{_e(c.beacon_index)}"
                f"</td><td><span class='pill p-{'passed' if revealed else 'pending'}'>"
                f"{'revealed' if revealed else 'awaiting reveal'}</span></td></tr>"
            )
        logged = (
            "<h3>Challenges in the log</h3><table><tr><th class='n'>round</th>"
            "<th class='n'>attempt</th><th>member</th><th>auditor</th><th class='n'>rate</th>"
            f"<th class='n'>beacon entry</th><th>reveal</th></tr>{''.join(items)}</table>"
        )
    if verdicts is None:
        found = "<h3>Verdicts</h3><p>none (no verdicts file was given)</p>"
    elif not verdicts:
        found = "<h3>Verdicts</h3><p>none (the verdicts file lists no challenge)</p>"
    else:
        rows = []
        for v in verdicts:
            passed = v.get("passed") is True
            failed = v.get("failed") or []
            scores = v.get("scores") if isinstance(v.get("scores"), dict) else {}
            assert isinstance(scores, dict)
            score_text = ", ".join(
                f"{_e(k)} {x:.3g}" if isinstance(x, int | float) else f"{_e(k)} {_e(x)}"
                for k, x in sorted(scores.items())
            )
            rows.append(
                f"<tr><td class='n'>{_e(v.get('round'))}</td>"
                f"<td class='n'>{_e(v.get('attempt', '–'))}</td><td>{_e(v.get('member'))}</td>"
                f"<td><span class='pill p-{'passed' if passed else 'failed'}'>"
                f"{'passed' if passed else 'FAILED'}</span></td>"
                f"<td>{_e(', '.join(map(str, failed)) if isinstance(failed, list) else failed)}"
                f"</td><td class='mono'>{score_text}</td></tr>"
            )
        bad = sum(1 for v in verdicts if v.get("passed") is not True)
        found = (
            f"<h3>Verdicts</h3><p>{len(verdicts)} checked, {bad} failed</p>"
            "<table><tr><th class='n'>round</th><th class='n'>attempt</th><th>member</th>"
            "<th>verdict</th><th>failed tests</th><th>scores</th></tr>"
            f"{''.join(rows)}</table>"
        )
    return (
        f'<h2>Control-sample challenges</h2><div class="card">{logged}{found}'
        f"{_quarantines(s)}</div>"
    )


def _quarantines(s: LogSummary) -> str:
    if not s.quarantines:
        return "<h3>Quarantined members</h3><p>none</p>"
    rows = "".join(
        f"<tr><td>{_e(q.member)}</td><td class='n'>{_e(q.round)}.{_e(q.attempt)}</td>"
        f"<td>{_e(', '.join(q.failed))}</td><td>{_e(q.issuer)}"
        f"{' (signed order)' if q.order is not None else ' (failed verdict)'}</td>"
        f"<td class='n'>{_e(q.rollback_to)}</td><td>{_e(q.reason)}</td></tr>"
        for q in s.quarantines
    )
    return (
        "<h3>Quarantined members</h3><table><tr><th>member</th><th class='n'>first failed "
        "round</th><th>failed tests</th><th>ordered by</th><th class='n'>rollback to "
        f"version</th><th>reason</th></tr>{rows}</table>"
    )


def events_section(s: LogSummary) -> str:
    if not s.events:
        return ""
    rows = "".join(
        f"<tr><td class='n'>{i}</td><td>{_e(kind)}</td><td>{_e(text)}</td></tr>"
        for i, kind, text in s.events
    )
    return (
        "<h2>Aborts, rollbacks, alerts, archive pruning and decryptions</h2>"
        "<div class='card'><table><tr>"
        f"<th class='n'>entry</th><th>kind</th><th>what</th></tr>{rows}</table></div>"
    )
