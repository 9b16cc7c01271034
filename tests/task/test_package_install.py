"""A task package installed by pip into a real virtual environment.

``fedsec task new`` writes the package; pip installs it (editable, then as a wheel)
into a temporary venv that sees this environment's packages through a ``.pth`` file
(``--system-site-packages`` would expose the base interpreter's, not this venv's);
``--no-deps --no-build-isolation --no-index`` keeps pip off the network. Each step
runs as a subprocess with a bounded timeout.
"""

from __future__ import annotations

import json
import site
import subprocess
import venv
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsec.task.cli import task as task_cli

pytestmark = pytest.mark.slow

NAME = "toy_xray"
#: pip installs and pytest runs on a loaded 2-core machine take seconds, never minutes.
STEP_TIMEOUT_S = 240


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _make_venv(root: Path) -> Path:
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root)
    python = root / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    (Path(purelib.strip()) / "_fedsec_parent_env.pth").write_text(lines, encoding="utf-8")
    return python


def _pip_install(python: Path, *target: str | Path) -> None:
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", *target)  # fmt: skip


def _digest(python: Path) -> str:
    out = _run(python, "-m", "fedsec", "task", "inspect", NAME, "--json")
    report = json.loads(out)
    assert (report["name"], report["distribution"], report["version"]) == (NAME, NAME, "0.1.0")
    assert report["params"] == 8 * 16 + 16 + 16 * 2 + 2 and report["dp_compatible"]
    return str(report["digest"])


#: What a member does with a round spec's pin: compare it with its own installation.
_MEMBER_CHECK = f"""
import sys
from fedsec.errors import TaskDigestMismatch
from fedsec.protocol.wire import TaskPin
from fedsec.task.digest import check_pin, loaded_task_pin
pinned = TaskPin("{NAME}", "{NAME}", "0.1.0", sys.argv[1])
try:
    check_pin(pinned, loaded_task_pin("{NAME}"), "round 3")
except TaskDigestMismatch as exc:
    print(exc.code, exc.detail)
"""


def test_new_package_installs_is_found_passes_its_test_and_is_pinned(tmp_path: Path) -> None:
    result = CliRunner().invoke(task_cli, ["new", NAME, "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    package = tmp_path / NAME
    python = _make_venv(tmp_path / "venv")

    _pip_install(python, "-e", package)
    _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=package)
    editable = _digest(python)
    assert _digest(python) == editable  # computed alike every time

    source = package / "src" / NAME / "task.py"
    source.write_text(source.read_text(encoding="utf-8") + "# changed\n", encoding="utf-8")
    changed = _digest(python)
    assert changed != editable
    # A member whose source changed refuses a round pinned to the package as it was.
    refusal = _run(python, "-c", _MEMBER_CHECK, editable)
    assert "task_digest_mismatch round 3: " in refusal
    assert f"digest expected '{editable}', installed '{changed}'" in refusal

    # Installed from a wheel, the digest covers the RECORD's files: tampering with an
    # installed module changes it too.
    _run(python, "-m", "pip", "uninstall", "-q", "-y", NAME)
    _pip_install(python, package)
    wheel = _digest(python)
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    installed = Path(purelib.strip()) / NAME / "task.py"
    installed.write_text(installed.read_text(encoding="utf-8") + "# tampered\n", "utf-8")
    assert _digest(python) not in (wheel, changed, editable)


def test_new_refuses_a_bad_name_or_an_existing_directory(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(task_cli, ["new", "Bad-Name", "--dir", str(tmp_path)])
    assert bad.exit_code != 0 and "lowercase letters" in str(bad.exception)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / NAME).mkdir()
    again = runner.invoke(task_cli, ["new", NAME, "--dir", str(tmp_path)])
    assert again.exit_code != 0 and "already exists" in str(again.exception)
    assert list((tmp_path / NAME).iterdir()) == []
