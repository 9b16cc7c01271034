"""The data settings of ``agent.toml``: sources and column rules.

Plain msgspec structs without the readers behind them, so ``fedsec.config`` can
validate a file without importing pyarrow or SQLAlchemy.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

SourceKind = Literal["csv", "parquet", "sql"]
GENERALISE_RULE = re.compile(
    r"^generalise:(prefix:(?P<prefix>[1-9][0-9]*)|bucket:(?P<bucket>[0-9.eE+-]+)|year)$"
)


class SourceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[data.sources]]`` entry of ``agent.toml``."""

    kind: SourceKind
    path: str = ""  # csv, parquet: the file, relative to agent.toml
    url: str = ""  # sql: SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db
    query: str = ""  # sql: the SELECT whose rows are the records
    password_file: str = ""  # sql: file (mode 0600) holding the password, not the URL
    name: str = ""  # how reports name it; default: the file name or the redacted URL
    delimiter: str = ","  # csv
    encoding: str = "utf-8"  # csv


class ColumnRules(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[data.rules]`` of ``agent.toml``."""

    rename: dict[str, str] = {}  # this member's column -> the federation's name
    exclude: list[str] = []  # columns that stay inside; never read into training
    anonymise: dict[str, str] = {}  # column (after renaming) -> drop | hash | generalise:...
    units: dict[str, str] = {}  # column -> unit of this member's values; default the schema's
    impute: Literal["mean", "median"] = "mean"  # the local statistic for missing = "impute"
    hash_key_file: str = ""  # the keyed hash's key; default <state_dir>/anonymise.key

    def check_problems(self) -> list[str]:
        """Each rule that cannot be applied, as ``key: reason``."""
        problems = [
            f"anonymise.{col}: expected drop, hash, generalise:prefix:N, "
            f"generalise:bucket:W or generalise:year, got {rule!r}"
            for col, rule in self.anonymise.items()
            if rule not in ("drop", "hash") and not GENERALISE_RULE.match(rule)
        ]
        targets = list(self.rename.values())
        dupes = sorted({t for t in targets if targets.count(t) > 1})
        if dupes:
            problems.append(f"rename: maps two columns onto {dupes}")
        return problems
