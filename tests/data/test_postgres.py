"""PostgreSQL as a member's store, for real: streamed reads, credentials, bad queries."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from fedsec.agent.cli import agent
from fedsec.data.inventory import profile_source
from fedsec.data.settings import SourceSpec
from fedsec.data.sources import open_source
from fedsec.errors import ConfigError
from tests.support.postgres import PASSWORD, USER, Postgres

ROWS = 1500  # small: the server-side cursor streams whatever the size


@pytest.fixture(scope="module")
def visits(postgres: Postgres) -> Postgres:
    dsn = postgres.url().replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE visits (id serial, patient_name text, email text, age int, "
            "bmi numeric(5,2), sex text, diagnosis text)"
        )
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO visits (patient_name, email, age, bmi, sex, diagnosis) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                [
                    (
                        f"Pat Person{i}",
                        f"p{i}@example.org",
                        20 + i % 60,
                        None if i % 10 == 0 else 18.5 + (i % 15),
                        "FM"[i % 2],
                        ("cold", "flu")[i % 3 == 0],
                    )
                    for i in range(ROWS)
                ],
            )
    return postgres


def test_a_query_is_profiled_with_the_owner_credentials(visits: Postgres) -> None:
    spec = SourceSpec(kind="sql", url=visits.url(), query="SELECT * FROM visits")
    source = open_source(spec)
    assert PASSWORD not in source.name and USER not in source.name
    profiles, rows = profile_source(source)
    p = {c.name: c for c in profiles}
    assert rows == ROWS
    assert p["bmi"].kind == "numeric" and p["bmi"].missing == ROWS // 10
    assert (p["age"].minimum, p["age"].maximum) == (20, 79)
    assert p["sex"].counts == {"F": ROWS // 2, "M": ROWS // 2}


def test_password_file_wrong_password_bad_query_and_no_rows(
    visits: Postgres, tmp_path: Path
) -> None:
    pw = tmp_path / "db.pass"
    pw.write_text(PASSWORD + "\n")
    pw.chmod(0o644)
    url = visits.url(password=False)
    spec = SourceSpec(kind="sql", url=url, query="SELECT 1", password_file=str(pw))
    with pytest.raises(ConfigError, match=r"password_file .* others may read it"):
        list(open_source(spec).chunks())
    pw.chmod(0o600)
    assert sum(c.rows for c in open_source(spec).chunks()) == 1
    wrong = url.replace(f"{USER}@", f"{USER}:not-it@")
    with pytest.raises(ConfigError, match="cannot connect to the database") as err:
        list(open_source(SourceSpec(kind="sql", url=wrong, query="SELECT 1")).chunks())
    assert "not-it" not in err.value.detail and USER not in err.value.detail
    bad = SourceSpec(kind="sql", url=visits.url(), query="SELECT nope FROM visits")
    with pytest.raises(ConfigError, match=r"the query failed: .*nope"):
        list(open_source(bad).chunks())
    empty = SourceSpec(kind="sql", url=visits.url(), query="SELECT * FROM visits WHERE age < 0")
    with pytest.raises(ConfigError, match="the query returned no rows"):
        list(open_source(empty).chunks())


def test_agent_inventory_on_postgres_keeps_the_credentials_out(
    visits: Postgres, tmp_path: Path
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        f"""[agent]
id = "hospital-a"
aggregator_url = "http://127.0.0.1:1"
aggregator_public_key = "{"0" * 64}"
[data]
task = "table"
[[data.sources]]
kind = "sql"
url = "{visits.url()}"
query = "SELECT patient_name, email, age, bmi, sex, diagnosis FROM visits"
[data.rules]
exclude = ["patient_name", "email"]
[data.schema]
label = "diagnosis"
classes = ["cold", "flu"]
columns = [{{ name = "age" }}, {{ name = "bmi", missing = "impute" }},
           {{ name = "sex", kind = "categorical", categories = ["F", "M"] }}]
"""
    )
    config.chmod(0o600)
    html = tmp_path / "map.html"
    result = CliRunner().invoke(
        agent, ["inventory", "--config", str(config), "--json", "--html", str(html)]
    )
    assert result.exit_code == 0, result.output
    assert PASSWORD not in result.output and PASSWORD not in html.read_text()
    data_map = json.loads(result.output)
    cols = {c["name"]: c for c in data_map["sources"][0]["columns"]}
    assert cols["patient_name"]["sensitive"]["category"] == "name"
    assert cols["email"]["sensitive"]["category"] == "email"
    assert cols["email"]["role"] == "stays inside"
    assert data_map["training"]["rows_kept"] == ROWS
    assert data_map["training"]["label_distribution"] == {"cold": 1000, "flu": 500}
