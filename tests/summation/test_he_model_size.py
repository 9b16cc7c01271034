"""Homomorphic summation refuses, at init, a model whose encrypted update the aggregator
would refuse every round, with a sentence giving the size and the bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsec.aggregator.workspace import init_workspace
from fedsec.config import default_federation_toml, parse_federation_config
from fedsec.errors import ConfigError
from fedsec.summation import mode_named

RESNET18_PARAMS = 11_181_642


def _he_toml(max_body_bytes: int = 64 * 2**20) -> str:
    text = default_federation_toml("f", "breast_cancer")
    text = text.replace('secure_sum = "secagg"', 'secure_sum = "he"')
    text = text.replace('custodian = ""', 'custodian = "kh"')
    text = text.replace("max_json_bytes = 1048576", "max_json_bytes = 65536")
    return text.replace("max_body_bytes = 67108864", f"max_body_bytes = {max_body_bytes}")


def test_a_resnet18_under_he_is_refused_with_its_size_and_bytes() -> None:
    config = parse_federation_config(_he_toml(), "federation.toml")
    he = mode_named("he")
    (problem,) = he.model_problems(config, RESNET18_PARAMS)
    # 2,730 ciphertexts of 4,096 slots, each up to 132,096 bytes at N = 8192, [60, 60]
    assert "model of 11,181,642 parameters" in problem
    assert "2,730 CKKS ciphertexts of up to 132,096 bytes, 360,622,080 bytes (344 MiB)" in problem
    assert "over server.max_body_bytes (67,108,864); at most 2,080,767 parameters fit" in problem
    assert 'secure_sum = "secagg"' in problem
    assert he.model_problems(config, 2_080_767) == []
    assert he.model_problems(config, 2_080_768) != []
    assert mode_named("secagg").model_problems(config, RESNET18_PARAMS) == []


def test_init_refuses_the_model_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    # breast_cancer's model (under 4,096 parameters) is one ciphertext: over 100 kB
    with pytest.raises(ConfigError, match=r"he cannot sum this task's model of [\d,]+ param"):
        init_workspace(root, "f", config_text=_he_toml(max_body_bytes=100_000))
    assert not root.exists()
    init_workspace(root, "f", config_text=_he_toml())
    assert (root / "federation.toml").exists()


def test_an_aggregator_started_on_a_config_edited_to_he_refuses_the_model(tmp_path: Path) -> None:
    from fedsec.aggregator.coordinator import Coordinator
    from fedsec.aggregator.workspace import Workspace

    root = tmp_path / "ws"
    init_workspace(root, "f", config_text=_he_toml())
    config = root / "federation.toml"
    config.write_text(_he_toml(max_body_bytes=100_000))
    with pytest.raises(ConfigError, match=r"over server\.max_body_bytes \(100,000\)"):
        Coordinator(Workspace.open(root))
