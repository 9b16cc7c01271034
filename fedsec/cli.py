"""The ``fedsec`` command line: one entry point, a group per role.

User errors (any :class:`FedsecError`) print their sentence and exit 1;
tracebacks are for our own bugs only.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any, cast

import click

from fedsec.cli_options import codec_options
from fedsec.errors import FedsecError


class _LazyGroup(click.Group):
    """A group whose subcommands from heavier modules are imported when one is named.

    A process then holds only its own command's code: ``fedsec aggregator serve``
    imported every role's stack with the group (the agent's, HE's tenseal, the
    benchmarks', PostgreSQL's driver), 37 MB of its resident memory at start. A module
    of fedsec's own that is not built is left out, as if the command did not exist.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, tuple[str, str]] = {}  # command name -> (module, attribute)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in self.lazy:
            return command
        module, attr = self.lazy[cmd_name]
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("fedsec"):
                return None  # not built yet
            raise
        command = cast(click.Command, getattr(loaded, attr))
        self.add_command(command, name=cmd_name)
        return command


class _FedsecGroup(_LazyGroup):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FedsecError as exc:
            click.echo(f"error: {exc.detail}", err=True)
            sys.exit(1)


@click.group(cls=_FedsecGroup)
@click.version_option(package_name="fedsec")
def main() -> None:
    """fedsec: federated learning with DP-SGD, SecAgg+ and a verifiable audit trail."""


@main.group(cls=_LazyGroup)
def bench() -> None:
    """Benchmarks; each prints one JSON object per line."""


@bench.command("secagg")
@click.option("--clients", default=100, show_default=True, help="cohort size n")
@click.option("--dim", default=1_000_000, show_default=True, help="model parameters d")
@click.option("--dropout", default=0.1, show_default=True, help="fraction of members lost")
@click.option(
    "--dropout-stage",
    type=click.Choice(["advertise", "share", "masked", "unmask"]),
    default="masked",
    show_default=True,
    help="when they are lost: before advertising, before sharing, after share keys, "
    "after the masked input",
)
@click.option("--neighbors", default=0, show_default=True, help="k; 0 = default rule")
@click.option("--threshold", default=0, show_default=True, help="t; 0 = majority of k")
@click.option("--bits", default=8, show_default=True, help="quantization bits b")
@click.option("--repeat", default=1, show_default=True, help="rounds to run (one line each)")
@click.option(
    "--ddp-noise",
    default=0.0,
    show_default=True,
    help="distributed DP: members add Skellam noise shares of this noise multiplier",
)
@codec_options
@click.option(
    "--ring-bits",
    default=0,
    show_default=True,
    help="a ring wider than the cohort needs (a larger cohort's); 0 = the round's rule",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_secagg(
    clients: int,
    dim: int,
    dropout: float,
    dropout_stage: str,
    neighbors: int,
    threshold: int,
    bits: int,
    repeat: int,
    ddp_noise: float,
    rotation: str,
    sparsity: float,
    range_stddevs: float,
    headroom_bits: int,
    ring_bits: int,
    as_json: bool,
) -> None:
    """One full SecAgg+ round in one process."""
    from fedsec.bench.secagg import run_secagg
    from fedsec.protocol.codec_choice import default_range_stddevs

    for _ in range(repeat):
        result = run_secagg(
            clients,
            dim,
            dropout,
            dropout_stage,
            neighbors,
            threshold,
            bits,
            ddp_noise=ddp_noise,
            rotation=rotation,
            keep=sparsity,
            range_stddevs=range_stddevs or default_range_stddevs(rotation),
            headroom_bits=headroom_bits,
            ring_bits=ring_bits,
        )
        click.echo(json.dumps(result))


def _register_optional() -> None:
    """Name the command groups whose modules need the heavier extras (torch, aiohttp);
    each is imported when its command is run (or listed by ``--help``)."""
    for module, names in (
        ("fedsec.aggregator.cli", ("aggregator",)),
        ("fedsec.agent.cli", ("agent",)),
        ("fedsec.audit.cli", ("audit",)),
        ("fedsec.custodian.cli", ("custodian",)),
        ("fedsec.demo", ("demo", "simulate")),
        ("fedsec.peer.cli", ("peer",)),
        ("fedsec.task.cli", ("task",)),
    ):
        for name in names:
            main.lazy[name] = (module, name.replace("-", "_"))
    assert isinstance(bench, _LazyGroup)  # its class, for the type checker
    for module, attr, name in (
        ("fedsec.bench.audit_cli", "bench_audit", "audit"),
        ("fedsec.bench.chaos", "bench_chaos", "chaos"),
        ("fedsec.bench.failover_cli", "bench_failover", "failover"),
        ("fedsec.bench.store", "bench_store", "store"),
        ("fedsec.bench.async_bench", "bench_async", "async"),
        ("fedsec.bench.ops", "bench_ops", "ops"),
        ("fedsec.bench.he", "bench_he", "he"),
        ("fedsec.bench.inventory", "bench_inventory", "inventory"),
        ("fedsec.bench.ddp", "bench_ddp", "ddp"),
        ("fedsec.bench.robust", "bench_robust", "robust"),
        ("fedsec.bench.gossip", "bench_gossip", "gossip"),
        ("fedsec.bench.compare", "bench_compare", "compare"),
        ("fedsec.bench.model_size", "bench_model_size", "model-size"),
        ("fedsec.bench.member_memory", "bench_member_memory", "member-memory"),
        ("fedsec.bench.workers", "bench_workers", "workers"),
        ("fedsec.bench.scale", "bench_scale", "scale"),
    ):
        bench.lazy[name] = (module, attr)


_register_optional()
