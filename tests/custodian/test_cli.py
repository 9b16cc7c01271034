"""``fedsec custodian init`` and the custodian's directory."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.cli import main
from fedsec.crypto import he
from fedsec.custodian.store import open_custodian
from fedsec.errors import IntegrityError, KeyFileError

INIT = ["custodian", "init", "--federation-id", "fed-he", "--poly-modulus-degree", "4096"]
SMALL = ["--coeff-mod-bit-sizes", "60,49", "--scale-bits", "40"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_writes_the_keys_and_prints_the_roster_command(tmp_path: Path) -> None:
    directory = tmp_path / "keeper"
    result = CliRunner().invoke(main, [*INIT, *SMALL, "--dir", str(directory), "--id", "keeper"])
    assert result.exit_code == 0, result.output

    names = {p.name for p in directory.iterdir()}
    assert names == {
        "identity.key",
        "identity.pub",
        "he-secret.ctx",
        "he-public.ctx",
        "custodian.json",
    }
    assert _mode(directory / "identity.key") == 0o600
    assert _mode(directory / "he-secret.ctx") == 0o600
    manifest = json.loads((directory / "custodian.json").read_text())
    public = (directory / "he-public.ctx").read_bytes()
    assert manifest["federation_id"] == "fed-he"
    assert manifest["coeff_mod_bit_sizes"] == [60, 49]
    assert manifest["context_sha256"] == hashlib.sha256(public).hexdigest()
    params = he.HeParams(4096, (60, 49), 40)
    he.load_public_context(public, params, params.context_max_bytes(secret=False))
    he.load_secret_context(
        (directory / "he-secret.ctx").read_bytes(), params, params.context_max_bytes(secret=True)
    )
    pub = (directory / "identity.pub").read_text().strip()
    assert f"public key: {pub}" in result.output
    assert (
        f"fedsec aggregator roster add --workspace W --agent-id keeper --role custodian "
        f"--public-key {directory / 'identity.pub'}" in result.output
    )
    opened = open_custodian(directory)
    assert opened.identity.public_bytes.hex() == pub


def test_init_refuses_to_overwrite_a_custodian(tmp_path: Path) -> None:
    directory = tmp_path / "keeper"
    runner = CliRunner()
    assert runner.invoke(main, [*INIT, *SMALL, "--dir", str(directory)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    again = runner.invoke(main, [*INIT, *SMALL, "--dir", str(directory)])
    assert again.exit_code == 1
    assert "refusing to overwrite a custodian" in again.output
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_init_refuses_bad_parameters_and_writes_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "keeper"
    result = CliRunner().invoke(
        main, [*INIT, "--coeff-mod-bit-sizes", "60,60,60", "--dir", str(directory)]
    )
    assert result.exit_code == 1
    assert "128-bit secure only up to 109 bits" in result.output
    assert not directory.exists()


def test_a_readable_secret_context_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keeper"
    CliRunner().invoke(main, [*INIT, *SMALL, "--dir", str(directory)])
    (directory / "he-secret.ctx").chmod(0o640)
    with pytest.raises(KeyFileError, match="treat it as leaked"):
        open_custodian(directory)


def test_a_swapped_public_context_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keeper"
    CliRunner().invoke(main, [*INIT, *SMALL, "--dir", str(directory)])
    _, other = he.generate_keys(he.HeParams(4096, (60, 49), 40))
    (directory / "he-public.ctx").write_bytes(other)
    with pytest.raises(IntegrityError, match="is not the context"):
        open_custodian(directory)
