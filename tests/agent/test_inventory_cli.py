"""``fedsec agent inventory`` and the agent's own checks on its table data."""

from __future__ import annotations

import stat
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fedsec.agent.cli import agent
from fedsec.agent.runtime import AgentRuntime
from fedsec.config import load_agent_config
from fedsec.crypto.identity import SigningIdentity
from fedsec.data.example import SCHEMA, write_hospital_exports
from fedsec.data.rules import load_hash_key
from fedsec.data.settings import ColumnRules
from fedsec.data.sources import open_source
from fedsec.data.table import build_table
from fedsec.errors import ConfigError

HEAD = """[agent]
id = "hospital-a"
aggregator_url = "http://127.0.0.1:9"
aggregator_public_key = "{key}"
state_dir = "state"
""".format(key="0" * 64)


def test_inventory_before_any_rules_and_without_a_source(tmp_path: Path) -> None:
    export = write_hospital_exports(tmp_path, rows=30)["hospital-c"]
    config = tmp_path / "agent.toml"
    config.write_text(HEAD + f'[data]\ntask = "csv"\ncsv = "{export.name}"\n')
    html = tmp_path / "map.html"
    args = ["inventory", "--config", str(config), "--html", str(html), "--label", "diagnosis"]
    result = CliRunner().invoke(agent, args)
    assert result.exit_code == 0, result.output
    assert "source csv:hospital-c.csv: 30 rows, 10 columns" in result.output
    assert "SENSITIVE name (by name: nm)" in result.output
    assert "SENSITIVE national_id (by name: ssn)" in result.output
    assert "no federation schema in [data.schema]" in result.output
    assert (
        "diagnosis                text     missing   0.0%  distinct 3      kept; label"
        in result.output
    )
    assert "    label distribution: {'diabetes': " in result.output
    assert (
        stat.S_IMODE(html.stat().st_mode) == 0o600
        and "<h2>csv:hospital-c.csv</h2>" in html.read_text()
    )
    config.write_text(HEAD)
    result = CliRunner().invoke(agent, ["inventory", "--config", str(config)])
    assert result.exit_code == 1
    assert result.output.startswith("error: nothing to inventory: add a [[data.sources]]")


def test_parquet_trains_like_csv_and_the_hash_key_is_private(tmp_path: Path) -> None:
    export = write_hospital_exports(tmp_path, rows=40)["hospital-a"]
    import pyarrow.csv as pacsv

    pq.write_table(pacsv.read_csv(export), tmp_path / "a.parquet")
    rules = ColumnRules(exclude=["patient_name"])
    from_csv = build_table([open_source(_spec("csv", export))], SCHEMA, rules, None)
    from_parquet = build_table(
        [open_source(_spec("parquet", tmp_path / "a.parquet"))], SCHEMA, rules, None
    )
    assert (from_csv.x == from_parquet.x).all() and (from_csv.y == from_parquet.y).all()
    key_file = tmp_path / "keys" / "anonymise.key"
    key = load_hash_key(str(key_file))
    assert len(key) == 32 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert load_hash_key(str(key_file)) == key
    key_file.chmod(0o644)
    with pytest.raises(ConfigError, match="others may read it"):
        load_hash_key(str(key_file))


def test_a_source_changed_after_loading_is_refused_before_training(tmp_path: Path) -> None:
    export = write_hospital_exports(tmp_path, rows=40)["hospital-a"]
    config = tmp_path / "agent.toml"
    config.write_text(
        HEAD
        + '[data]\ntask = "table"\n[[data.sources]]\nkind = "csv"\npath = "hospital-a.csv"\n'
        + '[data.rules]\nexclude = ["patient_name"]\n'
        + _schema_toml()
    )
    runtime = AgentRuntime(load_agent_config(config), SigningIdentity.generate())
    assert runtime.prepare().summary is not None
    runtime._check_sources_unchanged()  # unchanged: nothing to say
    with export.open("a") as fh:
        fh.write("Zed Doe,50,F,25.0,never,5.1,120,healthy\n")
    with pytest.raises(ConfigError, match=r"csv:hospital-a.csv changed since the agent read it"):
        runtime._check_sources_unchanged()


def _spec(kind: str, path: Path):  # type: ignore[no-untyped-def]
    from fedsec.data.settings import SourceSpec

    return SourceSpec(kind=kind, path=str(path))  # type: ignore[arg-type]


def _schema_toml() -> str:
    import msgspec

    from fedsec.config import toml_value

    doc = msgspec.to_builtins(SCHEMA)
    return "[data.schema]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in doc.items())
