"""``fedsec agent inventory``: this member's data map, from what ``agent.toml`` names.

The sources are ``[[data.sources]]``, or the ``data.csv`` file of a csv task; the rules
and the federation schema are used when present, so the command helps write the rules
first and shows what they keep afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsec.config import AgentConfig
from fedsec.errors import ConfigError


def member_data_map(cfg: AgentConfig, label: str = "") -> dict[str, Any]:
    """The data map of the sources ``cfg`` names (``label``: the label column, before a
    schema names it).

    Raises:
        ConfigError: no source configured, or a source cannot be read.
    """
    from fedsec.data.inventory import build_map
    from fedsec.data.rules import load_hash_key
    from fedsec.data.settings import SourceSpec
    from fedsec.data.sources import open_source

    specs = list(cfg.data.sources)
    if not specs and cfg.data.csv:
        specs = [SourceSpec(kind="csv", path=cfg.data.csv)]
    if not specs:
        raise ConfigError(
            "nothing to inventory: add a [[data.sources]] entry (csv, parquet or sql) to "
            "agent.toml, or set data.csv"
        )
    rules = cfg.data.rules
    key = None
    if rules is not None and "hash" in rules.anonymise.values():
        default = Path(cfg.agent.state_dir) / "anonymise.key"
        key = load_hash_key(rules.hash_key_file or str(default))
    data_map = build_map([open_source(s) for s in specs], rules, cfg.data.schema, key, label)
    data_map["member"] = cfg.agent.id
    return data_map
