"""Command-line options shared by several commands, in a module of their own so that
a command module (``fedsec.demo``) can use them without importing ``fedsec.cli``, which
imports every command module to register it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def codec_options(fn: F) -> F:
    """The update codec's options, as ``fedsec simulate`` and ``fedsec bench secagg``
    take them (``--rotation``, ``--sparsity``, ``--range-stddevs``, ``--headroom-bits``)."""
    for option in reversed(
        (
            click.option(
                "--rotation",
                type=click.Choice(["none", "hadamard"]),
                default="none",
                show_default=True,
                help="codec: the shared randomised Hadamard rotation",
            ),
            click.option(
                "--sparsity",
                default=1.0,
                show_default=True,
                help="codec: fraction of coordinates sent (a shared random subset)",
            ),
            click.option(
                "--range-stddevs",
                default=0.0,
                help="codec: rotated rounding range in std devs; 0 = 3 with rotation",
            ),
            click.option(
                "--headroom-bits",
                default=0,
                help="codec: ring bits above --quant-bits/--bits; 0 = none of a sum wraps",
            ),
        )
    ):
        fn = option(fn)
    return fn
