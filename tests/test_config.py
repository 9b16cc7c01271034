"""federation.toml and agent.toml: defaults, refusals naming key and reason, round trips."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.config import (
    DOCS,
    AgentConfig,
    AgentSection,
    FederationConfig,
    FederationSection,
    default_federation_toml,
    dump_agent_config,
    dump_federation_config,
    load_agent_config,
    load_federation_config,
    parse_agent_config,
    parse_federation_config,
    toml_value,
)
from fedsec.errors import ConfigError

KEY = "ab" * 32
AGENT_MIN = f"""
[agent]
id = "hospital-a"
aggregator_url = "https://agg.example:8443"
aggregator_public_key = "{KEY}"
"""


def _fed(extra: str) -> str:
    return '[federation]\nid = "fed-1"\n' + extra


def test_defaults() -> None:
    cfg = parse_federation_config(_fed(""))
    assert cfg.federation.task == "breast_cancer"
    assert cfg.round.quant_bits == 8 and cfg.round.min_agents == 3
    assert cfg.round.secure_sum == "secagg" and cfg.round.mode == "sync"
    assert cfg.server.max_body_bytes == 64 * 1024 * 1024
    assert cfg.server.max_json_bytes == 1024 * 1024
    assert cfg.server.port == 8443 and cfg.server.host == "127.0.0.1"
    assert cfg.dp.enabled and cfg.dp.delta == 1e-5
    agent = parse_agent_config(AGENT_MIN)
    assert agent.privacy.epsilon == 8.0 and agent.network.retry_max == 8
    assert agent.agent.device == "auto"
    assert agent.agent.aggregator_public_key_bytes == bytes.fromhex(KEY)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[round]\nquant_bits = 40", "round.quant_bits: expected an integer in 2..16, got 40"),
        ('[round]\nquant_bits = "8"', "round.quant_bits: expected an integer, got '8'"),
        ("[round]\nquant_bits = 8.0", "round.quant_bits: expected an integer, got 8.0"),
        ("[round]\nrounds = true", "round.rounds: expected an integer, got true"),
        ("[round]\nclip_norm = 0", "round.clip_norm: expected a number > 0, got 0.0"),
        ("[round]\nclip_norm = nan", "round.clip_norm: expected a number > 0, got nan"),
        ('[round]\nmode = "async"', "round.mode: expected one of 'sync', 'buffered', got 'async'"),
        ('[round]\nsecure_sum = "ckks"', "round.secure_sum: expected one of 'secagg', 'none'"),
        ("[round]\nquant_bit = 8", "round.quant_bit: unknown key"),
        ("[rounds]\nx = 1", "rounds: unknown key"),
        ("[round]\nmin_agents = 2", "round.min_agents: expected an integer in 3..100000, got 2"),
        ("[round]\nmin_agents = 20\nmax_agents = 10", "round.max_agents"),
        ("[round]\nneighbors = 4\nthreshold = 9", "round.threshold: expected an integer in 2..5"),
        ("[server]\nport = 70000", "server.port: expected an integer in 0..65535, got 70000"),
        ('[server]\noptimizer = "sgd"', "server.optimizer: expected one of 'fedavg', 'fedadam'"),
        ("[server]\nadam_beta2 = 1.0", "server.adam_beta2: expected a number in [0, 1)"),
        ('[server]\ntls_cert = "c.pem"', "server.tls_key: must be set"),
        ("[dp]\ndelta = 0", "dp.delta: expected a number in (0, 1), got 0.0"),
        ("[dp]\nnoise_multiplier = 0", "dp.noise_multiplier: expected a number > 0"),
        ("[training]\nbatch_size = 0", "training.batch_size: expected an integer >= 1, got 0"),
        ("task_options = 3", "federation.task_options: expected a table, got 3"),
    ],
)
def test_federation_refusals_name_key_and_reason(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_federation_config(_fed(text), "federation.toml")
    assert f"federation.toml: {message}" in str(err.value) or message in str(err.value)
    assert str(err.value).startswith("federation.toml: ")


def test_missing_required_and_bad_toml() -> None:
    with pytest.raises(ConfigError, match=r"federation\.id: required key is missing"):
        parse_federation_config("[federation]\n")
    with pytest.raises(ConfigError, match="federation: required key is missing"):
        parse_federation_config("")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_federation_config("[federation\n")
    with pytest.raises(ConfigError, match=r"federation\.id: expected 1-64 characters"):
        parse_federation_config('[federation]\nid = "a b"')


def test_none_secure_sum_allows_small_cohorts_and_dp_off() -> None:
    cfg = parse_federation_config(
        _fed(
            '[round]\nsecure_sum = "none"\nmin_agents = 1\n'
            "[dp]\nenabled = false\nnoise_multiplier = 0"
        )
    )
    assert cfg.round.min_agents == 1 and not cfg.dp.enabled


def test_several_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        parse_federation_config(_fed("[round]\nquant_bits = 1\nclip_norm = -1"))
    assert "round.quant_bits" in str(err.value) and "round.clip_norm" in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('aggregator_url = "ftp://x"', "agent.aggregator_url: expected an http:// or https:// URL"),
        ('device = "tpu"', "agent.device: expected auto, cpu, cuda, cuda:N or mps, got 'tpu'"),
        ("colour = 1", "agent.colour: unknown key"),
        ('[data]\npartition = "dirichlet:-1"', "data.partition: expected iid or dirichlet:ALPHA"),
        ('[data]\npartition = "shards"', "data.partition"),
        (
            "[data]\nparts = 3\npart_index = 3",
            "data.part_index: expected an integer in 0..2, got 3",
        ),
        ("[privacy]\nepsilon = -1", "privacy.epsilon: expected a number > 0, got -1.0"),
        (
            "[network]\nbackoff_initial_s = 5\nbackoff_max_s = 1",
            "network.backoff_max_s: expected a number >= backoff_initial_s (5.0), got 1.0",
        ),
    ],
)
def test_agent_refusals(text: str, message: str) -> None:
    base = AGENT_MIN
    if not text.startswith("["):
        base = base.replace('aggregator_url = "https://agg.example:8443"\n', "")
        if "aggregator_url" not in text:
            base += 'aggregator_url = "https://agg.example:8443"\n'
    with pytest.raises(ConfigError) as err:
        parse_agent_config(base + text + "\n", "agent.toml")
    assert message in str(err.value)


def test_bad_public_key_refused() -> None:
    with pytest.raises(ConfigError, match=r"agent\.aggregator_public_key: expected 64 hex digits"):
        parse_agent_config(AGENT_MIN.replace(KEY, "abcd"))


def test_data_helpers() -> None:
    cfg = parse_agent_config(
        AGENT_MIN + '[data]\npartition = "dirichlet:0.5"\nparts = 4\npart_index = 1\n'
    )
    assert cfg.data.dirichlet_alpha() == 0.5
    assert cfg.data.effective_dataset_id() == "breast_cancer:dirichlet:0.5:0:1/4"


def test_load_resolves_paths_relative_to_file(tmp_path: Path) -> None:
    sub = tmp_path / "conf"
    sub.mkdir()
    (sub / "agent.toml").write_text(AGENT_MIN + 'state_dir = "st"\n[data]\ncsv = "../d.csv"\n')
    cfg = load_agent_config(sub / "agent.toml")
    assert cfg.agent.state_dir == str(sub / "st")
    assert cfg.data.csv == str(tmp_path / "d.csv")
    (sub / "federation.toml").write_text(_fed('[server]\ntls_cert = "c.pem"\ntls_key = "/k.pem"\n'))
    fed = load_federation_config(sub / "federation.toml")
    assert fed.server.tls_cert == str(sub / "c.pem") and fed.server.tls_key == "/k.pem"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_federation_config(tmp_path / "nope.toml")


def test_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "federation.toml"
    path.write_text(_fed("[round]\nquant_bits = 40\n"))
    with pytest.raises(ConfigError, match=r"federation\.toml: round\.quant_bits"):
        load_federation_config(path)


def test_default_toml_is_documented_and_loads() -> None:
    text = default_federation_toml("fed-9", "digits")
    cfg = parse_federation_config(text)
    assert cfg == FederationConfig(federation=FederationSection(id="fed-9", task="digits"))
    for key in ("quant_bits", "clip_norm", "max_body_bytes", "noise_multiplier"):
        assert f"\n{key} = " in text
    assert text.count("\n# ") > 40
    with pytest.raises(ConfigError, match=r"federation\.id"):
        default_federation_toml("bad id")


def test_dump_round_trips(tmp_path: Path) -> None:
    fed = parse_federation_config(
        _fed(
            'task_options = { hidden = [16, 8], name = "q\\"x", "odd key" = { a = 1.5e-7 } }\n'
            '[round]\nmode = "buffered"\nclip_norm = 2.5\n[server]\noptimizer = "fedadam"\n'
        )
    )
    dump_federation_config(fed, tmp_path / "f.toml")
    assert load_federation_config(tmp_path / "f.toml") == fed
    agent = AgentConfig(
        agent=AgentSection(
            id="lab-1",
            aggregator_url="http://127.0.0.1:8443",
            aggregator_public_key=KEY,
            state_dir=str(tmp_path / "state"),
        )
    )
    dump_agent_config(agent, tmp_path / "a.toml")
    assert load_agent_config(tmp_path / "a.toml") == agent
    assert "# Total epsilon" in (tmp_path / "a.toml").read_text()


toml_scalars = (
    st.text(max_size=20)
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=10),
        toml_scalars | st.lists(toml_scalars, max_size=3),
        max_size=5,
    )
)
def test_toml_writer_round_trips(table: dict[str, object]) -> None:
    text = f"x = {toml_value(table)}\n"
    assert tomllib.loads(text) == {"x": table}


def test_every_key_is_documented() -> None:
    docs_md = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    for kind, root in ((FederationConfig, "federation"), (AgentConfig, "agent")):
        for section in msgspec.structs.fields(kind):
            for field in msgspec.structs.fields(section.type):
                path = f"{section.name}.{field.name}"
                assert path in DOCS, f"{root}: {path} has no comment"
                assert f"`{path}`" in docs_md, f"docs/config.md lacks {path}"


def test_aggregator_logging_survives_opacus_basic_config() -> None:
    import logging

    import opacus  # noqa: F401  (its import calls logging.basicConfig at WARNING)

    from fedsec.aggregator.cli import configure_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info")
        assert logging.getLogger("fedsec.aggregator.coordinator").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
