"""Sources read in chunks: CSV, Parquet and SQLite, and their bad inputs."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedsec.config import load_agent_config
from fedsec.data.inventory import build_map, profile_source
from fedsec.data.settings import SourceSpec
from fedsec.data.sources import open_source, redact_url
from fedsec.errors import ConfigError

ROWS = [
    ("pt_nm", "age", "sex", "contact", "bmi", "diagnosis"),
    ("John Smith", "47", "F", "john@example.com", "22.5", "flu"),
    ("Mary Jones", "51", "M", "mary.j@example.org", "", "cold"),
    ("Ann Lee", "abc", "F", "ann@example.net", "30.1", "flu"),
    ("Bob Stone", "62", "M", "bob@example.com", "NA", "cold"),
]


def write_csv(path: Path, rows: list[tuple[str, ...]] = ROWS) -> Path:
    path.write_text("\n".join(",".join(r) for r in rows) + "\n", encoding="utf-8")
    return path


def by_name(profiles: list) -> dict:  # type: ignore[type-arg]
    return {p.name: p for p in profiles}


def test_csv_profile_types_missing_and_the_row_of_a_mixed_column(tmp_path: Path) -> None:
    source = open_source(SourceSpec(kind="csv", path=str(write_csv(tmp_path / "a.csv"))))
    profiles, rows = profile_source(source)
    p = by_name(profiles)
    assert rows == 4
    assert p["bmi"].kind == "numeric" and p["bmi"].missing == 2
    assert (p["bmi"].minimum, p["bmi"].maximum) == (22.5, 30.1)
    assert p["age"].kind == "mixed"
    assert (p["age"].first_numeric_row, p["age"].first_text_row) == (1, 3)
    assert p["sex"].kind == "text" and p["sex"].counts == {"F": 2, "M": 2}


def test_parquet_and_sqlite_profile_like_the_csv(tmp_path: Path) -> None:
    header, *body = ROWS
    table = pa.table({h: [r[i] or None for r in body] for i, h in enumerate(header)})
    pq.write_table(table, tmp_path / "a.parquet")
    db = tmp_path / "a.db"
    with sqlite3.connect(db) as conn:
        conn.execute(
            "CREATE TABLE t (pt_nm TEXT, age TEXT, sex TEXT, contact TEXT, bmi REAL, "
            "diagnosis TEXT)"
        )
        conn.executemany(
            "INSERT INTO t VALUES (?,?,?,?,?,?)",
            [(*r[:4], float(r[4]) if r[4] not in ("", "NA") else None, r[5]) for r in body],
        )
    for spec in (
        SourceSpec(kind="parquet", path=str(tmp_path / "a.parquet")),
        SourceSpec(kind="sql", url=f"sqlite:///{db}", query="SELECT * FROM t"),
    ):
        p = by_name(profile_source(open_source(spec))[0])
        assert p["bmi"].kind == "numeric" and p["bmi"].missing == 2, spec.kind
        assert p["age"].kind == "mixed" and p["age"].first_text_row == 3, spec.kind
        assert p["sex"].counts == {"F": 2, "M": 2}, spec.kind


def test_sql_query_errors_and_no_rows_name_the_source(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    empty = open_source(SourceSpec(kind="sql", url=f"sqlite:///{db}", query="SELECT * FROM t"))
    with pytest.raises(ConfigError, match=r"sql:sqlite:///a.db: the query returned no rows"):
        list(empty.chunks())
    bad = open_source(SourceSpec(kind="sql", url=f"sqlite:///{db}", query="SELECT * FROM nope"))
    with pytest.raises(ConfigError, match=r"the query failed: no such table: nope"):
        list(bad.chunks())


def test_a_database_that_is_down_is_named_without_its_credentials() -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+psycopg://hospital_user:s3cr3t-pw@127.0.0.1:{port}/records"
    source = open_source(SourceSpec(kind="sql", url=url, query="SELECT 1"))
    assert source.name == f"sql:postgresql+psycopg://127.0.0.1:{port}/records"
    with pytest.raises(ConfigError, match="cannot connect to the database") as err:
        list(source.chunks())
    assert "s3cr3t-pw" not in err.value.detail and "hospital_user" not in err.value.detail
    assert redact_url(url) == f"postgresql+psycopg://127.0.0.1:{port}/records"


def test_non_utf8_and_ragged_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "latin.csv"
    path.write_bytes(b"name,city\nAnn,Paris\nBob,K\xf6ln\n")
    source = open_source(SourceSpec(kind="csv", path=str(path)))
    with pytest.raises(ConfigError, match=r"csv:latin.csv: line 3 column 'city' is not utf-8"):
        profile_source(source)
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("a,b\n1,2\n3,4,5\n")
    with pytest.raises(ConfigError, match=r"csv:ragged.csv: line 3 has 3 fields"):
        profile_source(open_source(SourceSpec(kind="csv", path=str(ragged))))


def test_missing_file_is_named(tmp_path: Path) -> None:
    for kind in ("csv", "parquet"):
        source = open_source(SourceSpec(kind=kind, path=str(tmp_path / f"gone.{kind}")))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=f"{kind}:gone.{kind}"):
            profile_source(source)


AGENT = """
[agent]
id = "h1"
aggregator_url = "http://127.0.0.1:1"
aggregator_public_key = "{key}"
[data]
task = "table"
[[data.sources]]
kind = "sql"
url = "{url}"
query = "SELECT * FROM t"
[data.schema]
label = "diagnosis"
classes = ["cold", "flu"]
columns = [{{ name = "bmi" }}]
"""


def test_a_config_holding_a_password_must_be_0600(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(AGENT.format(key="0" * 64, url="postgresql+psycopg://u:pw@127.0.0.1/db"))
    cfg.chmod(0o644)
    with pytest.raises(ConfigError, match=r"others may read it \(mode 0644\); run chmod 600"):
        load_agent_config(cfg)
    cfg.chmod(0o600)
    assert load_agent_config(cfg).data.sources[0].url.endswith("@127.0.0.1/db")
    # no password in the URL: the file's mode is the owner's business
    cfg.write_text(AGENT.format(key="0" * 64, url="postgresql+psycopg://u@127.0.0.1/db"))
    cfg.chmod(0o644)
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o644
    load_agent_config(cfg)


def test_data_map_before_any_rules(tmp_path: Path) -> None:
    source = open_source(SourceSpec(kind="csv", path=str(write_csv(tmp_path / "a.csv"))))
    data_map = build_map([source])
    cols = {c["name"]: c for c in data_map["sources"][0]["columns"]}
    assert cols["pt_nm"]["sensitive"]["category"] == "name"
    assert cols["contact"]["sensitive"] == {
        "category": "email",
        "by": "values",
        "evidence": "100% of sampled values",
    }
    assert cols["bmi"]["sensitive"] is None and cols["bmi"]["role"] == "no schema yet"
    assert "training" not in data_map


def test_table_configs_need_a_schema_sources_and_applicable_rules(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    base = AGENT.format(key="0" * 64, url="sqlite:///x.db")
    no_schema = base.split("[data.schema]")[0]
    cfg.write_text(no_schema)
    with pytest.raises(ConfigError, match=r"data.schema: task \"table\" needs"):
        load_agent_config(cfg)
    cfg.write_text(base.replace('classes = ["cold", "flu"]', 'classes = ["cold"]'))
    with pytest.raises(ConfigError, match="classes must be at least two distinct values"):
        load_agent_config(cfg)
    cfg.write_text(base + '[data.rules]\nanonymise = { bmi = "scramble" }\n')
    with pytest.raises(ConfigError, match=r"data.rules.anonymise.bmi: expected drop, hash"):
        load_agent_config(cfg)
    loaded = load_agent_config(_write(cfg, base))
    assert loaded.data.task_options == {"features": ["bmi"], "classes": ["cold", "flu"]}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_sqlite_mixed_types_and_dataset_ids_without_credentials(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (v)")  # SQLite: no type, every row its own
        conn.executemany("INSERT INTO t VALUES (?)", [(1,), (2.5,), ("abc",), (None,)])
    spec = SourceSpec(kind="sql", url=f"sqlite:///{db}", query="SELECT v FROM t")
    (p,), rows = profile_source(open_source(spec))
    assert (rows, p.kind, p.missing, p.first_numeric_row, p.first_text_row) == (4, "mixed", 1, 1, 3)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(AGENT.format(key="0" * 64, url="postgresql+psycopg://u:pw@127.0.0.1/db"))
    cfg.chmod(0o600)
    dataset = load_agent_config(cfg).data.effective_dataset_id()
    assert dataset.startswith("table:sql-") and "pw" not in dataset and "127.0.0.1" not in dataset
