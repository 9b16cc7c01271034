"""``fedsec custodian``: make the federation's key pair, and serve as its key custodian.

User errors (any :class:`~fedsec.errors.FedsecError`) print one sentence on stderr and
exit 1, without a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click

from fedsec.crypto import he
from fedsec.custodian.check import MAX_DECRYPTION_REFUSALS, MIN_CONTRIBUTORS
from fedsec.custodian.store import IDENTITY_PUB, create_custodian
from fedsec.errors import ConfigError
from fedsec.protocol.roster import ID_PATTERN

__all__ = ["custodian"]

_DEFAULTS = he.HeParams()


def _configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s level=%(levelname)s logger=%(name)s event=%(message)s")
    )
    root = logging.getLogger("fedsec")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _bit_sizes(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _hex_key(value: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"{what} must be 64 hex digits (an Ed25519 public key)")
    return raw


@click.group()
def custodian() -> None:
    """Key custodian of a homomorphic-summation federation: holds the secret key and
    decrypts only sums the transparency log proves."""


@custodian.command("init")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="new directory for the custodian's keys (must not exist or be empty)",
)
@click.option("--federation-id", required=True, help="the federation's id")
@click.option(
    "--poly-modulus-degree",
    type=int,
    default=_DEFAULTS.poly_modulus_degree,
    show_default=True,
    help="CKKS degree N (as [he] poly_modulus_degree)",
)
@click.option(
    "--coeff-mod-bit-sizes",
    default=",".join(map(str, _DEFAULTS.coeff_mod_bit_sizes)),
    show_default=True,
    callback=_bit_sizes,
    help="CKKS coefficient moduli bit sizes (as [he] coeff_mod_bit_sizes)",
)
@click.option(
    "--scale-bits",
    type=int,
    default=_DEFAULTS.scale_bits,
    show_default=True,
    help="CKKS scale 2^s (as [he] scale_bits)",
)
@click.option("--id", "custodian_id", default="ID", help="roster id, for the printed command")
def init_command(
    directory: Path,
    federation_id: str,
    poly_modulus_degree: int,
    coeff_mod_bit_sizes: tuple[int, ...],
    scale_bits: int,
    custodian_id: str,
) -> None:
    """Create the custodian's identity and the federation's CKKS key pair in DIR."""
    if not ID_PATTERN.fullmatch(federation_id):
        raise ConfigError(f"federation id {federation_id!r} is not a valid identifier")
    params = he.HeParams(poly_modulus_degree, coeff_mod_bit_sizes, scale_bits)
    manifest = create_custodian(directory, federation_id, params)
    click.echo(f"custodian of federation {federation_id} initialised in {directory}")
    click.echo(f"secret key and context: {directory}/identity.key, he-secret.ctx (mode 0600)")
    click.echo(f"public key: {manifest.public_key}")
    click.echo(f"context sha256: {manifest.context_sha256}")
    click.echo(
        "the federation's [he] section must read: "
        f"custodian = {custodian_id!r}, poly_modulus_degree = {params.poly_modulus_degree}, "
        f"coeff_mod_bit_sizes = {list(params.coeff_mod_bit_sizes)}, "
        f"scale_bits = {params.scale_bits}"
    )
    click.echo("enrol it with the consortium admin:")
    click.echo(
        f"  fedsec aggregator roster add --workspace W --agent-id {custodian_id} "
        f"--role custodian --public-key {directory / IDENTITY_PUB}"
    )


@custodian.command("serve")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    help="the directory made by fedsec custodian init",
)
@click.option("--id", "custodian_id", required=True, help="the custodian's roster id")
@click.option(
    "--aggregator-url",
    required=True,
    multiple=True,
    help="https://host:port of the aggregator; repeat it for each replica of a replicated one",
)
@click.option(
    "--aggregator-public-key", required=True, help="aggregator's Ed25519 key, 64 hex digits"
)
@click.option(
    "--admin-public-key",
    default=None,
    help="pin the consortium admin's key too (default: the log's genesis names it)",
)
@click.option(
    "--min-contributors",
    type=int,
    default=MIN_CONTRIBUTORS,
    show_default=True,
    help="never decrypt a sum of fewer contributions, whatever the federation says",
)
@click.option(
    "--max-decryption-refusals",
    type=int,
    default=MAX_DECRYPTION_REFUSALS,
    show_default=True,
    help="stop (and alert) after this many refusals decided by decrypting a contribution "
    "(over the whole decision log): each answers a question about plaintexts",
)
@click.option("--verbose", is_flag=True, help="debug logging")
def serve_command(
    directory: Path,
    custodian_id: str,
    aggregator_url: tuple[str, ...],
    aggregator_public_key: str,
    admin_public_key: str | None,
    min_contributors: int,
    max_decryption_refusals: int,
    verbose: bool,
) -> None:
    """Publish the public context and decrypt, round by round, the logged sums."""
    from fedsec.custodian.service import serve_directory

    _configure_logging(verbose)
    aggregator_key = _hex_key(aggregator_public_key, "--aggregator-public-key")
    admin_key = (
        None if admin_public_key is None else _hex_key(admin_public_key, "--admin-public-key")
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await serve_directory(
                directory,
                custodian_id,
                aggregator_url,
                aggregator_key,
                admin_key=admin_key,
                min_contributors=min_contributors,
                max_decryption_refusals=max_decryption_refusals,
                stop=stop,
            )
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    asyncio.run(main())
    click.echo(f"custodian {custodian_id}: stopped; decisions in {directory}")
