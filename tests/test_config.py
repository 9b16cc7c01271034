"""federation.toml and agent.toml: defaults, refusals naming key and reason, round trips."""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsec.config import (
    DDP_FEDADAM_LR,
    FEDADAM_LR,
    AgentConfig,
    AgentSection,
    FederationConfig,
    FederationSection,
    default_federation_toml,
    dump_agent_config,
    dump_federation_config,
    key_docs,
    load_agent_config,
    load_federation_config,
    parse_agent_config,
    parse_federation_config,
    render_toml,
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
        ("[round]\nmin_agents = 2", "round.min_agents: expected an integer in 3..65535, got 2"),
        ("[round]\nmin_agents = 20\nmax_agents = 10", "round.max_agents"),
        # k = 4: t must beat an equivocating aggregator with one colluder, 2t > 4 + 1
        ("[round]\nneighbors = 4\nthreshold = 9", "round.threshold: expected an integer in 3..5"),
        ("[round]\nneighbors = 4\nthreshold = 2", "round.threshold: expected an integer in 3..5"),
        ("[server]\nport = 70000", "server.port: expected an integer in 0..65535, got 70000"),
        ('[server]\noptimizer = "sgd"', "server.optimizer: expected one of 'fedavg', 'fedadam'"),
        ("[server]\nadam_beta2 = 1.0", "server.adam_beta2: expected a number in [0, 1)"),
        ('[server]\ntls_cert = "c.pem"', "server.tls_key: must be set"),
        ("[dp]\ndelta = 0", "dp.delta: expected a number in (0, 1), got 0.0"),
        ("[dp]\nnoise_multiplier = 0", "dp.noise_multiplier: expected a number > 0"),
        ("[training]\nbatch_size = 0", "training.batch_size: expected an integer >= 1, got 0"),
        ("task_options = 3", "federation.task_options: expected a table, got 3"),
        (
            "[alerts]\nwrap_rate_max = 1.5",
            "alerts.wrap_rate_max: expected a number in [0, 1], got 1.5",
        ),
        (
            "[alerts]\nwrap_rate_max = -0.1",
            "alerts.wrap_rate_max: expected a number in [0, 1], got -0.1",
        ),
        (
            "[alerts]\nwrap_rate_max = nan",
            "alerts.wrap_rate_max: expected a number in [0, 1], got nan",
        ),
        ('[alerts]\nwrap_rate_max = "0"', "alerts.wrap_rate_max: expected a number, got '0'"),
        ("[codec]\nheadroom_bits = 17", "codec.headroom_bits: expected an integer in 0..16"),
        ("[codec]\nheadroom_bits = -20", "codec.headroom_bits: expected an integer in 0..16"),
        (
            '[codec]\nkeep = 0.5\n[dp]\nenabled = true\nmode = "distributed"',
            "codec: compression cannot be on with distributed DP",
        ),
        (
            '[round]\nsecure_sum = "he"\n[codec]\nrotation = "hadamard"',
            "codec: compression cannot be on with round.secure_sum = 'he'",
        ),
        (
            "[codec]\nheadroom_bits = 4",
            "codec.headroom_bits: expected codec.rotation = 'hadamard', got 'none'",
        ),
        (
            '[round]\nquant_bits = 2\n[codec]\nrotation = "hadamard"\nheadroom_bits = 4',
            "codec.headroom_bits: expected a ring of quant_bits + headroom_bits bits that holds "
            "the weights of round.max_agents = 100 members, got 4",
        ),
    ],
)
def test_federation_refusals_name_key_and_reason(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_federation_config(_fed(text), "federation.toml")
    assert f"federation.toml: {message}" in str(err.value) or message in str(err.value)
    assert str(err.value).startswith("federation.toml: ")


def test_wrap_rate_max_defaults_above_the_ring_sizing_and_takes_its_whole_range() -> None:
    # a ring at its sizing limit puts 2·Q(3) ≈ 0.27 % of coordinates at its edge by
    # design: the default pages above that, not in every round of such a federation
    assert parse_federation_config(_fed("")).alerts.wrap_rate_max == 0.005
    for value in ("0", "0.001", "1"):
        cfg = parse_federation_config(_fed(f"[alerts]\nwrap_rate_max = {value}"))
        assert cfg.alerts.wrap_rate_max == float(value)


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
            # an optional section (X | None) is documented as X
            section_type = next(
                (t for t in typing.get_args(section.type) if t is not type(None)), section.type
            )
            for field in msgspec.structs.fields(section_type):
                path = f"{section.name}.{field.name}"
                assert path in key_docs(), f"{root}: {path} has no comment"
                assert f"`{path}`" in docs_md, f"docs/config.md lacks {path}"


def test_docs_config_md_says_what_each_field_says() -> None:
    # docs/config.md's meaning column is each field's docstring, the one place a key is
    # documented (fedsec.config.key_docs reads them)
    docs_md = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|.*\| (.*?) \|$", docs_md, re.M)
    assert {key for key, _ in rows} == set(key_docs())
    for key, meaning in rows:
        assert " ".join(meaning.split()) == key_docs()[key], f"docs/config.md: {key} differs"


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


# -- [aggregation]: robust rules of a trusted aggregator --------------------------------------

_TRUSTED = '[round]\nsecure_sum = "none"\nmin_agents = 5\n'


def test_aggregation_defaults_to_fedavg_with_no_threshold() -> None:
    ag = parse_federation_config(_fed("")).aggregation
    assert ag.rule == "fedavg" and ag.max_norm_ratio == 0.0 and ag.min_trust_score == 0.0


@pytest.mark.parametrize(
    "text",
    [
        '[aggregation]\nrule = "trimmed_mean"\ntrim_fraction = 0.2',
        '[aggregation]\nrule = "median"\nmax_norm_ratio = 3.0',
        '[aggregation]\nrule = "multi_krum"\nbyzantine = 1\nkrum_selected = 3',
        '[aggregation]\nrule = "centered_clipping"\nclip_radius = 0.2\nclip_iterations = 1',
        '[aggregation]\nrule = "dnc"\nbyzantine = 2',
        '[aggregation]\nrule = "fltrust"\nroot_records = 50\nmin_trust_score = 0.1',
    ],
)
def test_trusted_mode_takes_every_rule(text: str) -> None:
    cfg = parse_federation_config(_fed(_TRUSTED + text))
    assert cfg.aggregation.rule == tomllib.loads(text)["aggregation"]["rule"]


@pytest.mark.parametrize("secure_sum", ["secagg", "he"])
@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('rule = "median"', "aggregation.rule"),
        ("max_norm_ratio = 2.0", "aggregation.max_norm_ratio"),
    ],
)
def test_robust_rules_are_refused_where_no_update_is_visible(
    secure_sum: str, text: str, key: str
) -> None:
    extra = '[he]\ncustodian = "cust"\n' if secure_sum == "he" else ""
    with pytest.raises(ConfigError) as err:
        parse_federation_config(
            _fed(f'[round]\nsecure_sum = "{secure_sum}"\n{extra}[aggregation]\n{text}')
        )
    assert (
        f'{key}: needs round.secure_sum = "none": with {secure_sum} the aggregator sees only '
        "the sum of the updates, never one member's" in str(err.value)
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'rule = "trimmed_mean"\ntrim_fraction = 0.5',
            "aggregation.trim_fraction: expected a number in [0, 0.5) (β is the share cut at "
            "each end of every coordinate; at 1/2 nothing would remain), got 0.5",
        ),
        (
            'rule = "centered_clipping"\nclip_radius = 0',
            "aggregation.clip_radius: expected a number > 0",
        ),
        (
            'rule = "centered_clipping"\nclip_iterations = 0',
            "aggregation.clip_iterations: expected an integer in 1..100",
        ),
        (
            'rule = "fltrust"\nmin_trust_score = 1.5',
            "aggregation.min_trust_score: expected a number in [0, 1]",
        ),
        ("max_norm_ratio = 0.5", "aggregation.max_norm_ratio: expected 0 (off) or a number >= 1"),
        (
            'rule = "median"\ntrim_fraction = 0.2',
            "aggregation.trim_fraction: only rule trimmed_mean reads it, not median: remove it",
        ),
        (
            'rule = "fedavg"\nmin_trust_score = 0.3',
            "aggregation.min_trust_score: only rule fltrust reads it, not fedavg",
        ),
        (
            'rule = "multi_krum"\nbyzantine = 2',
            "round.min_agents: expected at least 2 * aggregation.byzantine + 3 = 7 for multi_krum",
        ),
        (
            'rule = "dnc"\nbyzantine = 3',
            "round.min_agents: expected at least 2 * aggregation.byzantine + 1 = 7 for dnc",
        ),
        (
            'rule = "multi_krum"\nkrum_selected = 5',
            "aggregation.krum_selected: expected at most round.min_agents - aggregation.byzantine "
            "= 4",
        ),
        ('rule = "krum"', "aggregation.rule: expected one of 'fedavg', 'trimmed_mean'"),
        ("byzantine = 1.0", "aggregation.byzantine: expected an integer, got 1.0"),
        ("beta = 0.1", "aggregation.beta: unknown key"),
    ],
)
def test_aggregation_refusals_name_key_and_reason(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_federation_config(_fed(_TRUSTED + "[aggregation]\n" + text), "federation.toml")
    assert message in str(err.value)


def test_fltrust_needs_bundled_task_data() -> None:
    with pytest.raises(ConfigError, match=r"aggregation\.rule: expected a bundled task"):
        parse_federation_config(
            '[federation]\nid = "fed-1"\ntask = "csv"\n'
            + _TRUSTED
            + '[aggregation]\nrule = "fltrust"'
        )


def test_aggregation_section_round_trips_documented(tmp_path: Path) -> None:
    cfg = parse_federation_config(
        _fed(_TRUSTED + '[aggregation]\nrule = "trimmed_mean"\ntrim_fraction = 0.2')
    )
    dump_federation_config(cfg, tmp_path / "federation.toml")
    text = (tmp_path / "federation.toml").read_text()
    assert "[aggregation]" in text and "# trimmed_mean: share beta cut" in text
    assert load_federation_config(tmp_path / "federation.toml") == cfg


_HIDDEN = (
    '[round]\nsecure_sum = "he"\nmin_agents = 3\n[he]\ncustodian = "cust"\n'
    "model_visible_to_aggregator = false\n"
)


def test_a_hidden_model_needs_no_validation_fedavg_and_sync_rounds() -> None:
    cfg = parse_federation_config(_fed(_HIDDEN + "[validation]\nenabled = false\n"))
    assert cfg.he.model_visible_to_aggregator is False
    with pytest.raises(ConfigError) as err:
        parse_federation_config(
            _fed(
                _HIDDEN.replace("min_agents = 3\n", 'min_agents = 3\nmode = "buffered"\n')
                + '[server]\noptimizer = "fedadam"\n'
            )
        )
    text = str(err.value)
    assert "validation.enabled: expected false when he.model_visible_to_aggregator" in text
    assert "server.optimizer: expected fedavg when he.model_visible_to_aggregator" in text
    assert "round.mode: expected sync when he.model_visible_to_aggregator" in text


_DDP = '[dp]\nenabled = true\nmode = "distributed"\nsample_rate = 0.25\n'


@pytest.mark.parametrize(
    ("extra", "optimizer", "lr"),
    [
        ("", "fedavg", 1.0),  # no DP
        (_DDP, "fedadam", DDP_FEDADAM_LR),  # record-level distributed DP: the recipe
        (_DDP + 'unit = "member"\n', "fedavg", 1.0),
        (_DDP + '[server]\noptimizer = "fedavg"\n', "fedavg", 1.0),  # named: kept
        (_DDP + "[server]\nserver_lr = 0.5\n", "fedadam", 0.5),
        ('[server]\noptimizer = "fedadam"\n', "fedadam", FEDADAM_LR),
    ],
)
def test_the_server_optimiser_follows_the_dp_mode_where_unset(
    extra: str, optimizer: str, lr: float
) -> None:
    cfg = parse_federation_config(_fed('task = "mnist1d"\n' + extra))
    assert (cfg.server.optimizer, cfg.server.server_lr) == (optimizer, lr)


def test_a_generated_file_leaves_the_derived_keys_unset_so_they_follow_dp() -> None:
    text = default_federation_toml("fed-1", "mnist1d")
    assert (
        parse_federation_config(text).server.optimizer,
        parse_federation_config(text).server.server_lr,
    ) == ("fedavg", 1.0)
    assert "\n# optimizer = " in text and "\n# server_lr = " in text
    # the operator turns distributed DP on in the generated file and nothing else
    head, dp_table = text.split("\n[dp]\n", 1)
    dp_table, tail = dp_table.split("\n[", 1)
    for key, value in (("enabled", "true"), ("mode", '"distributed"'), ("sample_rate", "0.25")):
        dp_table = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", dp_table)
    edited = f"{head}\n[dp]\n{dp_table}\n[{tail}"
    cfg = parse_federation_config(edited)
    assert (cfg.dp.mode, cfg.dp.enabled) == ("distributed", True)
    assert (cfg.server.optimizer, cfg.server.server_lr) == ("fedadam", DDP_FEDADAM_LR)
    # a value the operator set stays written, and round-trips
    named = FederationConfig(federation=FederationSection(id="fed-1", task="mnist1d"))
    named = msgspec.structs.replace(
        named, server=msgspec.structs.replace(named.server, server_lr=0.3)
    )
    assert parse_federation_config(render_toml(named, "t")).server.server_lr == 0.3
