"""``fedsec peer run --config peer.toml``: one member's gossip peer (docs/decentralised.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import click
import numpy as np
from aiohttp import web

from fedsec.agent.ledger import PrivacyLedger
from fedsec.crypto.identity import key_id
from fedsec.errors import FedsecError
from fedsec.keys import load_identity
from fedsec.learning.training import DPParams, fresh_seed
from fedsec.peer.config import (
    PeerConfig,
    dataset_id,
    load_peer_config,
    member_keys,
    tls_contexts,
)
from fedsec.peer.gossip import GossipPeer, GossipSettings, RoundOutcome
from fedsec.peer.http import ARRIVED, peer_app
from fedsec.peer.journal import PeerJournal
from fedsec.peer.privacy import PeerCharging, holder_of
from fedsec.peer.runner import Timing, Trainer, run_rounds, task_trainer
from fedsec.peer.topology import topology_graph
from fedsec.tasks import get_task
from fedsec.tasks.base import TrainingParams
from fedsec.tasks.params import flatten_params
from fedsec.tasks.partition import parse_partition


@click.group()
def peer() -> None:
    """Decentralised mode: train with neighbours, no aggregator."""


@peer.command("run")
@click.option("--config", "config_path", type=click.Path(path_type=Path), required=True)
def run(config_path: Path) -> None:
    """Run this member's peer for the configured rounds, printing each round's outcome."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    try:
        config = load_peer_config(config_path)
        outcomes = asyncio.run(_run(config, config_path.parent))
    except FedsecError as exc:
        raise click.ClickException(str(exc)) from None
    for o in (o for o in outcomes if o.exchange == 0):  # where neighbours are judged
        click.echo(
            f"round={o.round} accepted={len(o.accepted)} refused={len(o.refused)} "
            f"missing={len(o.missing)}"
        )


async def _run(config: PeerConfig, home: Path) -> list[RoundOutcome]:
    identity = load_identity(home / config.key_file)
    roster = member_keys(config, home)
    server_tls, client_tls = tls_contexts(config, home)
    urls = {key_id(bytes.fromhex(m.public_key)): m.url for m in config.members}
    admin = bytes.fromhex(config.admin_public_key)
    graph = topology_graph(config.topology, admin, config.federation_id, roster)
    if identity.key_id not in roster:
        raise click.ClickException(f"this member's key {identity.key_id} is not in members")
    trainer, samples, start, params, dp = _trainer(config)
    charging = _charging(config, home, samples, params, dp)
    g = config.gossip
    journal = PeerJournal.resume(config.federation_id, identity, home / config.journal_file)
    state = GossipPeer(
        config.federation_id,
        identity.key_id,
        graph.neighbors(identity.key_id),
        start,
        samples,
        journal,
        GossipSettings(
            g.robust, g.min_cosine, g.staleness, g.reference, g.exchanges, g.max_norm_ratio
        ),
    )
    app = peer_app(state, roster, identity)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port, ssl_context=server_tls).start()
        neighbours = {n: urls[n] for n in state.neighbours}
        timing = Timing(g.round_timeout_s, g.send_timeout_s, g.send_timeout_s)
        try:
            return await run_rounds(
                state,
                identity,
                neighbours,
                trainer,
                config.rounds,
                app[ARRIVED],
                timing,
                roster,
                catch_up_at_start=True,
                tls=client_tls,
                charging=charging,
            )
        finally:
            # sign what this run journalled, also when it stops early (a spent budget):
            # an unsigned tail fails the audit's cross-check
            if journal.entries and journal.entries[-1].kind != "head":
                journal.head()
    finally:
        await runner.cleanup()


def _charging(
    config: PeerConfig, home: Path, samples: int, params: TrainingParams, dp: DPParams | None
) -> PeerCharging:
    """The member's ledger in ``state_dir``, its budget set as ``[privacy]`` says; refused
    before the endpoint starts when DP is off but required, or nothing is left."""
    ledger = PrivacyLedger(home / config.state_dir)
    dataset = dataset_id(config)
    charging = PeerCharging(
        ledger,
        dataset,
        holder_of(config.federation_id),
        samples,
        params,
        dp,
        config.privacy.require_dp,
    )
    spent = ledger.ensure_budget(dataset, config.privacy.epsilon, config.training.delta)
    logging.getLogger("fedsec.peer").info(
        "event=peer_ready dataset=%s spent=%.3f budget=%g", dataset, spent, config.privacy.epsilon
    )
    return charging


def _trainer(
    config: PeerConfig,
) -> tuple[Trainer, int, np.ndarray, TrainingParams, DPParams | None]:
    t = config.training
    task = get_task(t.task)
    data = task.load()
    idx = parse_partition(t.partition).apply(data.y_train, t.shards, t.seed)[t.shard]
    params = task.defaults
    if t.local_epochs:
        params = dataclasses.replace(params, local_epochs=t.local_epochs)
    dp = DPParams(t.noise_multiplier, t.max_grad_norm, t.delta) if t.noise_multiplier else None
    trainer = task_trainer(task, data.x_train[idx], data.y_train[idx], params, dp, fresh_seed())
    start = flatten_params(task.build_model(t.seed)).astype(np.float64)
    return trainer, len(idx), start, params, dp
