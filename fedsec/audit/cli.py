"""``fedsec audit``: independent verification of a federation's records."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TypeVar

import click

from fedsec.errors import ConfigError

F = TypeVar("F", bound=Any)

LOG_FILE = Path("audit/log.jsonl")
ARCHIVE_DIR = Path("audit/archive")


def find_workspace(root: Path) -> Path:
    """The aggregator workspace at ``root`` or, for a demo directory, ``root/aggregator``."""
    for candidate in (root, root / "aggregator"):
        if (candidate / LOG_FILE).exists():
            return candidate
    raise ConfigError(f"no transparency log under {root} (looked for {LOG_FILE})")


def _receipt_files(dirs: tuple[Path, ...]) -> list[Path]:
    files: list[Path] = []
    for d in dirs:
        if d.is_file():
            files.append(d)
        elif d.is_dir():
            files.extend(sorted(p for p in d.rglob("*.json") if p.is_file()))
        else:
            raise ConfigError(f"receipts path {d} does not exist")
    return files


def _record_options(fn: F) -> F:
    """The options naming a federation's records (shared by verify and report)."""
    for option in reversed(
        (
            click.option(
                "--log", "log_path", type=click.Path(path_type=Path, exists=True, dir_okay=False)
            ),
            click.option("--archive", type=click.Path(path_type=Path, file_okay=False)),
            click.option(
                "--models",
                type=click.Path(path_type=Path, file_okay=False),
                help="aggregator workspace holding models/ (to re-derive model versions)",
            ),
            click.option(
                "--workspace",
                type=click.Path(path_type=Path, exists=True, file_okay=False),
                help="aggregator (or demo) workspace: finds log, archive, models",
            ),
            click.option(
                "--receipts",
                type=click.Path(path_type=Path, exists=True),
                multiple=True,
                help="receipt files or directories (repeatable)",
            ),
            click.option("--aggregator-key", help="pin the aggregator's public key (hex)"),
        )
    ):
        fn = option(fn)
    return fn


def _records(
    log_path: Path | None,
    archive: Path | None,
    models: Path | None,
    workspace: Path | None,
    aggregator_key: str | None,
) -> tuple[Path, Path | None, Path | None, bytes | None]:
    """Resolve the record options: a workspace fills in whatever was not given."""
    if workspace is not None:
        ws = find_workspace(workspace)
        log_path = log_path or ws / LOG_FILE
        archive = archive or ws / ARCHIVE_DIR
        models = models or ws
    if log_path is None:
        raise ConfigError("give --log PATH or --workspace DIR")
    try:
        pinned = bytes.fromhex(aggregator_key) if aggregator_key else None
    except ValueError:
        raise ConfigError("--aggregator-key must be hex") from None
    return log_path, archive, models, pinned


def _echo_task_pins(pins: list[dict[str, Any]], checked: bool) -> None:
    """One line per task package the specs pin, and whether it was compared here."""
    compared = "matches the one installed here" if checked else "not compared (--check-task-pin)"
    for row in pins:
        pin, rounds = row["pin"], row["rounds"]
        span = (
            f"{len(rounds)} rounds from {rounds[0]} to {rounds[-1]}"
            if len(rounds) > 1
            else f"round {rounds[0]}"
        )
        if pin is None:
            click.echo(f"{span}: specs pin no task package (signed before pinning)")
        else:
            click.echo(
                f"{span}: task {pin['entry_point']} from {pin['distribution']} "
                f"{pin['version']}, digest {pin['digest'][:16]}…: {compared}"
            )


@click.group()
def audit() -> None:
    """Compliance side: verify the log, challenge members, report."""


@audit.command("verify")
@_record_options
@click.option(
    "--key",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="a recipient's identity key (the auditor's), to open and re-derive hidden models "
    "(he.model_visible_to_aggregator = false)",
)
@click.option(
    "--check-task-pin",
    is_flag=True,
    help="require every round spec to pin the task package installed here (same "
    "distribution, version and digest of its files)",
)
@click.option(
    "--peer-journal",
    "peer_journals",
    type=click.Path(path_type=Path, exists=True),
    multiple=True,
    help="a gossip peer's journal, or a directory of them (*.jsonl); repeatable: their "
    "chains and heads are checked and they are cross-checked against each other",
)
@click.option(
    "--peer-key",
    "peer_keys",
    multiple=True,
    help="a peer member's public key (hex), repeatable: each journal's heads must be "
    "signed by one of them",
)
@click.option("--json", "as_json", is_flag=True)
def verify_cmd(
    log_path: Path | None,
    archive: Path | None,
    models: Path | None,
    workspace: Path | None,
    receipts: tuple[Path, ...],
    aggregator_key: str | None,
    key: Path | None,
    check_task_pin: bool,
    peer_journals: tuple[Path, ...],
    peer_keys: tuple[str, ...],
    as_json: bool,
) -> None:
    """Check the chain, signatures, aggregates, models, receipts and ε; exit 0 only if all
    hold.  With --peer-journal, cross-check gossip peers' journals (alone, or as well)."""
    from fedsec.audit.verify import verify_log
    from fedsec.keys import load_identity

    peers_ok = True
    if peer_journals:
        peers_ok = _verify_peer_journals(peer_journals, peer_keys, as_json)
        if log_path is None and workspace is None:
            sys.exit(0 if peers_ok else 1)
    log_path, archive, models, pinned = _records(
        log_path, archive, models, workspace, aggregator_key
    )
    reader = None
    if key is not None:
        identity = load_identity(key)
        reader = (identity.public_bytes, identity.x25519_secret())
    result = verify_log(
        log_path, archive, models, _receipt_files(receipts), pinned, reader, check_task_pin
    )
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(
            f"entries {result.entries}, signed heads {result.heads}, rounds re-aggregated "
            f"{result.rounds_verified}, model versions re-derived {result.models_verified}, "
            f"privacy reports {result.privacy_reports}, receipts {result.receipts_checked}"
        )
        if result.hidden_unopened:
            click.echo(
                f"{result.hidden_unopened} hidden model version(s) not re-derived: give --key "
                "with a recipient's identity key (the auditor's) to open them"
            )
        for pruned in result.pruned_rounds:
            click.echo(f"round {pruned['round']}: not re-aggregated, {pruned['detail']}")
        _echo_task_pins(result.task_pins, result.task_pin_checked and result.ok)
        for underived in result.underived_rounds:
            click.echo(
                f"round {underived['round']} attempt {underived['attempt']} "
                f"({underived['rule']}): {underived['detail']}"
            )
        click.echo("OK: every check holds" if result.ok else f"FAILED: {result.problem}")
    sys.exit(0 if result.ok and peers_ok else 1)


def _verify_peer_journals(paths: tuple[Path, ...], keys: tuple[str, ...], as_json: bool) -> bool:
    from fedsec.audit.peer_journals import cross_check_journals, journal_files
    from fedsec.crypto.identity import key_id

    if not keys:
        raise ConfigError("--peer-journal needs the members' public keys: give --peer-key HEX")
    try:
        publics = [bytes.fromhex(k) for k in keys]
    except ValueError:
        raise ConfigError("--peer-key must be hex") from None
    if any(len(p) != 32 for p in publics):
        raise ConfigError("--peer-key must be a 32-byte Ed25519 public key in hex")
    result = cross_check_journals(journal_files(paths), {key_id(p): p for p in publics})
    if as_json:
        click.echo(json.dumps({"peer_journals": result.as_dict()}))
    else:
        click.echo(
            f"peer journals {result.journals}, entries {result.entries}, messages matched "
            f"{result.matched}, with members not given {result.outside}, catch-ups matched "
            f"{result.catch_ups}"
        )
        click.echo("OK: peer journals agree" if result.ok else f"FAILED: {result.problem}")
    return result.ok


def _auditor_options(fn: F) -> F:
    """How an auditor reaches the aggregator (shared by challenge and check)."""
    for option in reversed(
        (
            click.option(
                "--url",
                required=True,
                multiple=True,
                help="aggregator base URL; repeat it for each replica of a replicated one",
            ),
            click.option(
                "--key",
                type=click.Path(path_type=Path, exists=True, dir_okay=False),
                required=True,
                help="the auditor's identity key (roster role auditor)",
            ),
            click.option("--aggregator-key", required=True, help="aggregator public key (hex)"),
        )
    ):
        fn = option(fn)
    return fn


def _auditor_client(url: tuple[str, ...], key: Path, aggregator_key: str) -> tuple[Any, Any]:
    from fedsec.aggregator_client import AggregatorClient
    from fedsec.keys import load_identity

    identity = load_identity(key)
    try:
        aggregator_public = bytes.fromhex(aggregator_key)
    except ValueError:
        raise ConfigError("--aggregator-key must be hex") from None
    client = AggregatorClient(
        url,
        identity,
        aggregator_public,
        timeout_s=30.0,
        retry_max=4,
        backoff_initial_s=0.5,
        backoff_max_s=5.0,
    )
    return identity, client


@audit.command("challenge")
@_auditor_options
@click.option(
    "--log",
    "log_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    required=True,
    help="the federation's transparency log",
)
@click.option(
    "--rate",
    type=float,
    default=0.2,
    show_default=True,
    help="probability that a member's round is challenged",
)
@click.option("--round", "rounds", type=int, multiple=True, help="only these rounds")
def challenge_cmd(
    url: tuple[str, ...],
    key: Path,
    aggregator_key: str,
    log_path: Path,
    rate: float,
    rounds: tuple[int, ...],
) -> None:
    """Challenge the (member, round) pairs the signed log heads select at RATE."""
    import asyncio

    from fedsec.audit.challenge import draw_challenges

    requests = draw_challenges(log_path, rate, set(rounds) if rounds else None)
    _, client = _auditor_client(url, key, aggregator_key)

    async def main() -> int:
        try:
            for req in requests:
                await client.challenge(req)
                click.echo(f"challenged {req.member} for round {req.round}.{req.attempt}")
        finally:
            await client.close()
        return len(requests)

    click.echo(f"{asyncio.run(main())} challenge(s) sent")


@audit.command("report")
@_record_options
@click.option(
    "--verdicts",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="challenge verdicts (JSON) from `fedsec audit check`",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="HTML file to write (self-contained, opens offline)",
)
def report_cmd(
    log_path: Path | None,
    archive: Path | None,
    models: Path | None,
    workspace: Path | None,
    receipts: tuple[Path, ...],
    aggregator_key: str | None,
    verdicts: Path | None,
    out: Path,
) -> None:
    """Verify the log and write a one-file HTML report; exit 0 only if verification holds."""
    from fedsec.audit.report import build_report
    from fedsec.fsio import atomic_write

    log_path, archive, models, pinned = _records(
        log_path, archive, models, workspace, aggregator_key
    )
    page, result = build_report(
        log_path, archive, models, _receipt_files(receipts), pinned, verdicts
    )
    try:
        atomic_write(out, page.encode())
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {out}: {exc.strerror}") from None
    click.echo(f"report written to {out}")
    click.echo("OK: every check holds" if result.ok else f"FAILED: {result.problem}")
    sys.exit(0 if result.ok else 1)


@audit.command("check")
@_auditor_options
@click.option(
    "--workspace",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="workspace holding the log and model store (or a copy)",
)
@click.option(
    "--control-sample",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    required=True,
    help=".npz with arrays x and y drawn from the task's distribution",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="write the verdicts as JSON (for `fedsec audit report --verdicts`)",
)
@click.option(
    "--submit/--no-submit",
    default=False,
    help="also send the verdicts to the aggregator (signed): the dashboard shows them and "
    "a failed one raises an audit_failed alert",
)
@click.option(
    "--quarantine/--no-quarantine",
    default=False,
    help="also order each failed member's quarantine (signed by this auditor): the "
    "aggregator suspends it from future cohorts and offers a rollback",
)
def check_cmd(
    url: tuple[str, ...],
    key: Path,
    aggregator_key: str,
    workspace: Path,
    control_sample: Path,
    out: Path | None,
    submit: bool,
    quarantine: bool,
) -> None:
    """Open the reveals sealed to this auditor and judge each against the control sample."""
    import asyncio

    from fedsec.audit.check import check_reveals

    ws = find_workspace(workspace)
    identity, client = _auditor_client(url, key, aggregator_key)

    async def fetch() -> Any:
        try:
            return (await client.reveals()).reveals
        finally:
            await client.close()

    verdicts = check_reveals(identity, asyncio.run(fetch()), ws / LOG_FILE, ws, control_sample)
    for v in verdicts:
        status = "PASS" if v["passed"] else "FAIL " + ",".join(v["failed"])
        click.echo(f"round {v['round']}.{v['attempt']} {v['member']}: {status}")
    if out is not None:
        out.write_text(json.dumps({"verdicts": verdicts}, indent=1))
    if submit and verdicts:
        _submit_verdicts(url, key, aggregator_key, verdicts)
    if quarantine:
        _order_quarantines(url, key, aggregator_key, ws, verdicts)
    sys.exit(0 if all(v["passed"] for v in verdicts) else 1)


def _submit_verdicts(
    url: tuple[str, ...], key: Path, aggregator_key: str, verdicts: list[dict[str, Any]]
) -> None:
    """Send the verdicts, signed, to the aggregator, and say what it did with them."""
    import asyncio

    from fedsec.protocol import wire

    submission = wire.VerdictSubmission(
        verdicts=[
            wire.AuditVerdict(
                round=v["round"],
                attempt=v["attempt"],
                member=v["member"],
                passed=v["passed"],
                failed=list(v["failed"]),
            )
            for v in verdicts
        ]
    )
    _, sender = _auditor_client(url, key, aggregator_key)

    async def send() -> wire.VerdictReceipt:
        try:
            answer: wire.VerdictReceipt = await sender.submit_verdicts(submission)
            return answer
        finally:
            await sender.close()

    receipt = asyncio.run(send())
    click.echo(
        f"submitted: {receipt.stored} new, {receipt.already} already held, "
        f"{receipt.alerts} audit_failed alerts raised, {receipt.quarantined} quarantined"
    )


def _order_quarantines(
    url: tuple[str, ...], key: Path, aggregator_key: str, ws: Path, verdicts: list[dict[str, Any]]
) -> None:
    """Post one signed quarantine order per failed member, naming its first failed round."""
    import asyncio
    import time

    from fedsec.audit.log import read_log
    from fedsec.protocol import wire
    from fedsec.protocol.log_entries import GenesisEntry
    from fedsec.protocol.roster import RosterEntry

    identity, client = _auditor_client(url, key, aggregator_key)
    bodies = [entry.decode() for entry in read_log(ws / LOG_FILE)]
    genesis = bodies[0] if bodies else None
    if not isinstance(genesis, GenesisEntry):
        raise ConfigError(f"{ws / LOG_FILE} does not start with a genesis entry")
    mine = [
        b.agent_id
        for b in bodies
        if isinstance(b, RosterEntry) and b.public_key == identity.public_bytes.hex()
    ]
    if not mine:
        raise ConfigError("this auditor's key is not on the roster the log holds")
    first: dict[str, dict[str, Any]] = {}
    for v in sorted(verdicts, key=lambda v: (v["round"], v["attempt"])):
        if not v["passed"]:
            first.setdefault(v["member"], v)
    issuer = mine[-1]
    orders = [
        wire.QuarantineOrder(
            federation_id=genesis.federation_id,
            member=member,
            round=v["round"],
            attempt=v["attempt"],
            issuer=issuer,
            failed=list(v["failed"]),
            reason="fedsec audit check",
            issued_at=time.time(),
        ).sign(identity)
        for member, v in sorted(first.items())
    ]

    async def send() -> list[wire.QuarantineAnswer]:
        try:
            return [await client.quarantine(order) for order in orders]
        finally:
            await client.close()

    for answer in asyncio.run(send()):
        click.echo(answer.detail)
