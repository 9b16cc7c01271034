"""``fedsec bench audit``: the click command; the lead attaches it to the ``bench`` group."""

from __future__ import annotations

import json

import click

from fedsec.errors import ConfigError

DEFAULT_ATTACKS = "zero,noise,replay,signflip,scale"


@click.command("audit")
@click.option("--task", default="mnist1d", show_default=True, help="bundled task name")
@click.option("--agents", default=20, show_default=True, help="members per federation")
@click.option("--rounds", default=5, show_default=True, help="FedAvg rounds")
@click.option("--bad", default=0.2, show_default=True, help="fraction of attacking members")
@click.option(
    "--attacks",
    default=DEFAULT_ATTACKS,
    show_default=True,
    help="comma list of zero, noise, replay, signflip, scale",
)
@click.option("--dp-epsilon", default=8.0, show_default=True, help="DP budget over all rounds")
@click.option("--trials", default=2, show_default=True, help="federations with fresh seeds")
@click.option("--seed", default=0, show_default=True, help="first trial's seed")
@click.option("--json", "as_json", is_flag=True, help="print JSON (the default format)")
def bench_audit(
    task: str,
    agents: int,
    rounds: int,
    bad: float,
    attacks: str,
    dp_epsilon: float,
    trials: int,
    seed: int,
    as_json: bool,
) -> None:
    """Detection rates of the control-sample audit on simulated DP-SGD rounds."""
    from fedsec.bench.audit import run_audit_bench

    names = tuple(a.strip() for a in attacks.split(",") if a.strip())
    if not names:
        raise ConfigError("--attacks needs at least one attack name")
    result = run_audit_bench(
        task=task,
        agents=agents,
        rounds=rounds,
        bad=bad,
        attacks=names,
        dp_epsilon=dp_epsilon,
        seed=seed,
        trials=trials,
    )
    click.echo(json.dumps(result))
