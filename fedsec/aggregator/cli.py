"""``fedsec aggregator``: create a federation, manage its roster, serve it, roll back."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import ssl
from pathlib import Path
from typing import get_args

import click

from fedsec.aggregator.workspace import Workspace, init_workspace
from fedsec.errors import ConfigError
from fedsec.faults import Faults
from fedsec.keys import load_public_key
from fedsec.protocol.roster import Role, sign_roster_entry

SERVE_INFO = "serve.json"


@click.group()
def aggregator() -> None:
    """Consortium side: federation workspace, roster, HTTP service."""


@aggregator.command("init")
@click.option("--dir", "root", type=click.Path(path_type=Path), required=True)
@click.option("--federation-id", required=True)
@click.option("--task", default="breast_cancer", show_default=True)
@click.option("--config", "config_file", type=click.Path(path_type=Path, exists=True))
def init_cmd(root: Path, federation_id: str, task: str, config_file: Path | None) -> None:
    """Create a workspace: keys, federation.toml, roster, initial model."""
    text = config_file.read_text() if config_file else None
    ws = init_workspace(root, federation_id, task, config_text=text)
    click.echo(f"federation {ws.federation_id} created in {root}")
    click.echo(f"aggregator public key: {ws.signer.public_bytes.hex()}")
    click.echo(f"admin key: {root / 'admin.key'} (keep it offline once the roster is set up)")
    ws.close()


@aggregator.group()
def roster() -> None:
    """Add or revoke members (admin-signed)."""


@roster.command("add")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--agent-id", required=True)
@click.option("--public-key", type=click.Path(path_type=Path, exists=True), required=True)
@click.option("--role", type=click.Choice(get_args(Role)), default="agent")
@click.option("--max-weight", type=float, default=None)
def roster_add(
    workspace: Path, agent_id: str, public_key: Path, role: str, max_weight: float | None
) -> None:
    """Enrol a member; a serving aggregator picks it up within a second."""
    ws = Workspace.open(workspace)
    entry = sign_roster_entry(
        federation_id=ws.federation_id,
        agent_id=agent_id,
        public_key=load_public_key(public_key),
        role=role,  # type: ignore[arg-type]
        admin=ws.admin(),
        max_weight=max_weight,
    )
    ws.roster.add(entry)
    click.echo(f"added {agent_id} ({role}, key {entry.key_id})")
    ws.close()


@roster.command("revoke")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--agent-id", required=True)
def roster_revoke(workspace: Path, agent_id: str) -> None:
    """Revoke a member's key; its requests are refused from then on."""
    ws = Workspace.open(workspace)
    ws.roster.revoke(agent_id, ws.admin())
    click.echo(f"revoked {agent_id}")
    ws.close()


@aggregator.command("serve")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--host", default=None, help="default: server.host from federation.toml")
@click.option("--port", type=int, default=None, help="default: server.port; 0 = any free port")
@click.option("--tls-cert", type=click.Path(path_type=Path), default=None)
@click.option("--tls-key", type=click.Path(path_type=Path), default=None)
@click.option("--log-level", default="INFO", show_default=True)
def serve(
    workspace: Path,
    host: str | None,
    port: int | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    log_level: str,
) -> None:
    """Run the aggregator until interrupted."""
    configure_logging(log_level)
    ws = Workspace.open(workspace)
    cfg = ws.config.server
    cert = tls_cert or (Path(cfg.tls_cert) if cfg.tls_cert else None)
    key = tls_key or (Path(cfg.tls_key) if cfg.tls_key else None)
    if (cert is None) != (key is None):
        raise ConfigError("TLS needs both a certificate and a key")
    ssl_ctx = None
    if cert and key:
        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(cert, key)
    # chaos tests and the demo hand a child aggregator its faults through the environment
    faults = Faults.from_environment("aggregator")
    asyncio.run(_serve(ws, host or cfg.host, cfg.port if port is None else port, ssl_ctx, faults))


async def _serve(
    ws: Workspace, host: str, port: int, ssl_ctx: ssl.SSLContext | None, faults: Faults
) -> None:
    from fedsec.aggregator.replica import serve_replica

    info = ws.root / SERVE_INFO

    def serving(url: str) -> None:
        info.write_text(json.dumps({"url": url, "pid": os.getpid()}))
        click.echo(f"aggregator for {ws.federation_id} listening on {url}", err=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # a replica stands by while another leads, and leads once that one's lease expired
    await serve_replica(ws, host, port, ssl_ctx, stop, faults=faults, on_serving=serving)
    info.unlink(missing_ok=True)
    ws.close()


def configure_logging(level: str) -> None:
    """Log to stderr at ``level``.

    ``force``: importing Opacus (through the tasks) calls ``logging.basicConfig`` at
    WARNING, which would otherwise make this call a no-op and drop every INFO event.
    """
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        force=True,
    )


@aggregator.command("group-serve")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option(
    "--url",
    required=True,
    help="this server's base URL, exactly as round.group_servers lists it",
)
@click.option("--host", default=None, help="default: the URL's host")
@click.option("--port", type=int, default=None, help="default: the URL's port; 0 = any free")
@click.option("--tls-cert", type=click.Path(path_type=Path), default=None)
@click.option("--tls-key", type=click.Path(path_type=Path), default=None)
@click.option("--log-level", default="INFO", show_default=True)
def group_serve(
    workspace: Path,
    url: str,
    host: str | None,
    port: int | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    log_level: str,
) -> None:
    """Serve the stage requests of the shard groups the spec gives URL, over the
    leader's state store (docs/deployment.md, "Group servers")."""
    from urllib.parse import urlsplit

    from fedsec.aggregator.groups.server import serve_group

    configure_logging(log_level)
    # never the lease: a group server writes under the leader's token (GroupDesk)
    ws = Workspace.open(workspace, lead=False)
    if url.rstrip("/") not in [u.rstrip("/") for u in ws.config.round.group_servers]:
        ws.close()
        raise ConfigError(f"--url {url!r} is not one of round.group_servers")
    parts = urlsplit(url)
    ssl_ctx = None
    if tls_cert and tls_key:
        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(tls_cert, tls_key)
    bind_host = host or parts.hostname or "127.0.0.1"
    bind_port = (parts.port or 0) if port is None else port

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def serving(bound: str) -> None:
            click.echo(f"group server {url} listening on {bound}", err=True)

        await serve_group(ws, url, bind_host, bind_port, ssl_ctx, stop, serving)

    asyncio.run(main())
    ws.close()


@aggregator.command("rollback")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--to", "version", type=int, required=True)
@click.option("--note", default="")
def rollback(workspace: Path, version: int, note: str) -> None:
    """Publish a new version whose weights are those of VERSION (history kept, signed)."""
    ws = Workspace.open(workspace)
    manifest = ws.models.rollback(version, note=note or f"rollback to version {version}")
    click.echo(f"version {manifest.version} now holds the weights of version {version}")
    ws.close()


@aggregator.command("quarantine")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--member", required=True, help="the agent the control-sample audit failed")
@click.option("--round", "round_", type=int, required=True, help="its first failed round")
@click.option("--attempt", type=int, default=0, show_default=True)
@click.option("--failed", default="", help="the failed checks, comma-separated")
@click.option("--reason", default="", help="why, in a sentence (logged)")
def quarantine_cmd(
    workspace: Path, member: str, round_: int, attempt: int, failed: str, reason: str
) -> None:
    """Order MEMBER's quarantine, signed with the admin key: a serving aggregator carries
    it out within a second (log entry, member_quarantined alert, joins refused)."""
    import time

    import msgspec

    from fedsec.aggregator.rounds.quarantine import ADMIN, ORDERS_DIR
    from fedsec.fsio import atomic_write
    from fedsec.protocol import wire
    from fedsec.protocol.roster import ID_PATTERN

    if not ID_PATTERN.match(member):
        raise ConfigError(f"--member {member!r} is not a roster id")
    ws = Workspace.open(workspace)
    order = wire.QuarantineOrder(
        federation_id=ws.federation_id,
        member=member,
        round=round_,
        attempt=attempt,
        issuer=ADMIN,
        failed=[name for name in failed.split(",") if name],
        reason=reason,
        issued_at=time.time(),
    ).sign(ws.admin())
    path = workspace / ORDERS_DIR / f"{member}-{round_}.{attempt}.json"
    atomic_write(path, msgspec.json.encode(order), parents_mode=0o700)
    click.echo(f"quarantine order for {member} written to {path}")
    ws.close()


@aggregator.command("status")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
def status_cmd(workspace: Path) -> None:
    """Print rounds and model versions from the workspace's state."""
    ws = Workspace.open(workspace)
    for row in ws.state.rounds.history():
        click.echo(
            f"round {row.round}.{row.attempt}: {row.stage} model={row.model_version} {row.detail}"
        )
    click.echo(f"latest model version: {ws.models.latest().version}")
    ws.close()


@aggregator.command("inventory")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--json", "as_json", is_flag=True)
def inventory_cmd(workspace: Path, as_json: bool) -> None:
    """Members' latest signed data summaries (records, labels, missing rates, quality)."""
    from fedsec.aggregator.rounds.data_summaries import latest_summaries
    from fedsec.protocol import wire

    ws = Workspace.open(workspace)
    try:
        summaries = latest_summaries(line for _, line in ws.state.log.log_lines())
    finally:
        ws.close()
    rows = [summaries[m] for m in sorted(summaries)]
    if as_json:
        click.echo(wire.encode(rows).decode())
        return
    if not rows:
        click.echo("no data summaries yet (they arrive with joins in a federation with a [schema])")
    for d in rows:
        noise = f", counts noised at epsilon {d.count_epsilon:g}" if d.count_epsilon else ""
        worst = max(d.missing_rate.items(), key=lambda kv: kv[1], default=("-", 0.0))
        click.echo(
            f"{d.member}: {d.records} records{noise}; labels {d.label_counts}; "
            f"label coverage {d.label_coverage:.2f}; worst missing rate {worst[1]:.1%} "
            f"({worst[0]}); quality {d.quality_score:.3f}; schema {d.schema_fingerprint[:16]}"
        )


@aggregator.command("dashboard-token")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--observer", required=True, help="an active observer of the roster")
@click.option(
    "--scope",
    type=click.Choice(["dashboard", "metrics"]),
    default="dashboard",
    show_default=True,
    help="dashboard: the dashboard in a browser; metrics: the /metrics scrape",
)
@click.option(
    "--ttl-s",
    type=float,
    default=None,
    help="lifetime in seconds (default: dashboard.token_ttl_s; at most 30 days)",
)
def dashboard_token(workspace: Path, observer: str, scope: str, ttl_s: float | None) -> None:
    """Issue a token for an observer (printed once; only its hash is stored)."""
    import time

    from fedsec.aggregator.ops import tokens

    ws = Workspace.open(workspace)
    try:
        ttl = ttl_s if ttl_s is not None else ws.config.dashboard.token_ttl_s
        token, row = tokens.issue(
            ws.state.tokens,
            ws.roster,
            observer,
            scope,  # type: ignore[arg-type]
            ttl,
            time.time(),
        )
        click.echo(token)
        click.echo(
            f"{scope} token for {observer}, id {row.sha256[:12]}, expires "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(row.expires_at))}",
            err=True,
        )
        if scope == "dashboard":
            # the token goes into the sign-in form, never into an address (history, logs)
            click.echo(
                f"open {_served_url(ws)}/dashboard and paste the token into its sign-in form",
                err=True,
            )
        else:
            click.echo("scrape with the header  Authorization: Bearer <token>", err=True)
    finally:
        ws.close()


def _served_url(ws: Workspace) -> str:
    """The URL the workspace is served on now (serve.json), else the configured one."""
    try:
        return str(json.loads((ws.root / SERVE_INFO).read_text())["url"])
    except (OSError, ValueError, KeyError):
        cfg = ws.config.server
        scheme = "https" if cfg.tls_cert else "http"
        return f"{scheme}://{cfg.host}:{cfg.port}"


@aggregator.group()
def tokens() -> None:
    """List or revoke observers' dashboard and scrape tokens."""


@tokens.command("list")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
def tokens_list(workspace: Path) -> None:
    """Every token issued: id (hash prefix), observer, scope, expiry, state."""
    import time

    ws = Workspace.open(workspace)
    try:
        now = time.time()
        for row in ws.state.tokens.all():
            state = "revoked" if row.revoked else "expired" if now >= row.expires_at else "valid"
            expires = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row.expires_at))
            click.echo(f"{row.sha256[:12]}  {row.observer}  {row.scope}  {expires} UTC  {state}")
    finally:
        ws.close()


@tokens.command("revoke")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--id", "token_id", required=True, help="the id `tokens list` shows")
def tokens_revoke(workspace: Path, token_id: str) -> None:
    """Revoke a token at once (a serving aggregator refuses it from its next request)."""
    ws = Workspace.open(workspace)
    try:
        found = [r for r in ws.state.tokens.all() if r.sha256.startswith(token_id.lower())]
        if len(token_id) < 8 or len(found) != 1:
            raise ConfigError(f"--id {token_id!r} names {len(found)} tokens; give 8+ hex digits")
        ws.state.tokens.revoke(found[0].sha256)
        click.echo(f"revoked {found[0].sha256[:12]} ({found[0].observer}, {found[0].scope})")
    finally:
        ws.close()


@aggregator.group()
def alerts() -> None:
    """Operator alerts: list them, acknowledge them."""


@alerts.command("list")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--all", "show_all", is_flag=True, help="acknowledged ones too")
@click.option("--json", "as_json", is_flag=True)
def alerts_list(workspace: Path, show_all: bool, as_json: bool) -> None:
    """Open alerts (newest first); with --all, the history."""
    import time

    from fedsec.aggregator.rounds.alerts import alert_view
    from fedsec.protocol import wire

    ws = Workspace.open(workspace)
    try:
        rows = [r for r in ws.state.alerts.recent(10_000) if show_all or r.acked_at is None]
        if as_json:
            click.echo(wire.encode([alert_view(r) for r in rows]).decode())
            return
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.raised_at))
            state = f"acknowledged by {r.acked_by}" if r.acked_at is not None else "OPEN"
            click.echo(f"#{r.id}  {when} UTC  {r.kind}  {state}\n    {r.detail}")
        if not rows:
            click.echo("no open alerts" if not show_all else "no alerts")
    finally:
        ws.close()


@alerts.command("ack")
@click.option("--workspace", type=click.Path(path_type=Path), required=True)
@click.option("--id", "alert_id", type=int, required=True)
@click.option("--by", default="operator", show_default=True, help="who acknowledges")
def alerts_ack(workspace: Path, alert_id: int, by: str) -> None:
    """Acknowledge an alert: it leaves the open list; the same alert may be raised again."""
    import time

    from fedsec.errors import NotFound

    ws = Workspace.open(workspace)
    try:
        row = ws.state.alerts.get(alert_id)
        if row is None:
            raise NotFound(f"no alert #{alert_id}")
        if not ws.state.alerts.ack(alert_id, by, time.time()):
            click.echo(f"alert #{alert_id} was already acknowledged by {row.acked_by}")
            return
        click.echo(f"acknowledged #{alert_id} ({row.kind}: {row.detail})")
    finally:
        ws.close()
