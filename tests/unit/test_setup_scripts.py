"""scripts/pkg.sh, the installer behind scripts/setup.sh: uv gets pip's settings, and pip takes over
when uv cannot install (or is not wanted)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; . {ROOT}/scripts/pkg.sh; {script}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def clean_env(virtual_env: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "EARL_"))}
    env.update(VIRTUAL_ENV=str(virtual_env), PATH=f"{virtual_env}/bin:{env['PATH']}", **extra)
    return env


def test_uv_gets_pips_indexes_find_links_and_cert():
    this_venv = Path(sys.executable).parent.parent
    env = clean_env(
        this_venv,
        PIP_FIND_LINKS="/wheels/a /wheels/b",
        PIP_INDEX_URL="https://index.example/simple",
        PIP_EXTRA_INDEX_URL="file:///x/simple file:///y/simple",
        PIP_CERT="/certs/ca.pem",
        PIP_TRUSTED_HOST="mirror.example",
        PIP_NO_INDEX="true",
    )
    lines = bash("_uv_env", env).stdout.splitlines()
    assert lines == [
        f"UV_PYTHON={this_venv}/bin/python",
        "UV_COMPILE_BYTECODE=1",
        "UV_INDEX_STRATEGY=unsafe-best-match",
        "UV_FIND_LINKS=/wheels/a,/wheels/b",
        "UV_EXTRA_INDEX_URL=file:///x/simple file:///y/simple",
        "UV_INDEX_URL=https://index.example/simple",
        "UV_INSECURE_HOST=mirror.example",
        "UV_NO_INDEX=1",
        "SSL_CERT_FILE=/certs/ca.pem",
    ]
    # No settings anywhere (pip reads no config file): uv is given none either.
    lines = bash("_uv_env", clean_env(this_venv, PIP_CONFIG_FILE=os.devnull)).stdout.splitlines()
    assert [line.split("=")[0] for line in lines] == [
        "UV_PYTHON",
        "UV_COMPILE_BYTECODE",
        "UV_INDEX_STRATEGY",
    ]


def tiny_wheel(folder: Path) -> Path:
    """A one-module wheel, written by hand (no build backend, no index)."""
    path = folder / "earl_setup_probe-0.1-py3-none-any.whl"
    info = "earl_setup_probe-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("earl_setup_probe.py", "VALUE = 7\n")
        whl.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: earl-setup-probe\nVersion: 0.1\n"
        )
        whl.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def scratch_venv(tmp_path):
    where = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(where)
    return where


@pytest.mark.parametrize("case", ["uv fails", "pip wanted"])
def test_pip_installs_when_uv_fails_or_is_not_wanted(tmp_path, scratch_venv, case):
    calls = tmp_path / "uv_calls"
    fake_uv = scratch_venv / "bin" / "uv"  # an uv that cannot install anything
    fake_uv.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    fake_uv.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tiny_wheel(wheels)
    env = clean_env(scratch_venv, **({"EARL_INSTALLER": "pip"} if case == "pip wanted" else {}))
    run = bash(f"pkg_install --no-index --find-links {wheels} earl-setup-probe", env)
    assert run.returncode == 0, run.stderr
    probe = subprocess.run(
        [scratch_venv / "bin" / "python", "-c", "import earl_setup_probe as p; print(p.VALUE)"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "7"
    if case == "uv fails":
        assert "failed; trying pip" in run.stdout
        assert calls.read_text().startswith("pip install -q --no-index")
    else:
        assert not calls.exists() and "trying pip" not in run.stdout


def test_an_unknown_installer_is_refused_by_name(scratch_venv):
    run = bash("pkg_install earl-setup-probe", clean_env(scratch_venv, EARL_INSTALLER="poetry"))
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "setup: EARL_INSTALLER='poetry' is not an installer this set-up knows; "
        "use 'uv' (the default) or 'pip'"
    )
