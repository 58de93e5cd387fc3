"""tests/gpu/device_check.py: the requirement check the GPU machine runs over the carried wheels
(installed with ``pip --target``, where ``pip check`` does not look) and the project's own list."""

from __future__ import annotations

from importlib import metadata

import pytest

from tests.gpu.device_check import check, main, unmet


def _dist(site, name: str, version: str, requires: list[str]) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_unmet_names_missing_and_out_of_range_requirements_only():
    torch = metadata.version("torch")
    got = unmet(
        [
            "torch>=1.0",
            "torch<1.0",
            "surely-not-installed-pkg>=1",
            'packaging; python_version < "3"',
            "vllm>=0.1",
        ],
        set(),
        "demo 1.0",
    )
    assert got == [
        f"demo 1.0: torch<1.0 (found {torch})",
        "demo 1.0: surely-not-installed-pkg>=1 (not installed)",
    ]


def test_extras_count_only_when_asked_for():
    reqs = ['surely-not-installed-pkg; extra == "fancy"']
    assert unmet(reqs, set(), "demo") == []
    assert unmet(reqs, {"fancy"}, "demo") == [
        'demo: surely-not-installed-pkg; extra == "fancy" (not installed)'
    ]


def test_check_reads_the_site_folder_and_the_project(tmp_path):
    site = tmp_path / "site"
    _dist(site, "carried", "2.0", ["packaging", "surely-not-installed-pkg==3"])
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "proj"\ndependencies = ["torch>=99"]\n')
    got = check(site, pyproject)
    assert got[0] == "carried 2.0: surely-not-installed-pkg==3 (not installed)"
    assert got[1].startswith("proj: torch>=99 (found ") and len(got) == 2


def test_this_environment_meets_the_project_s_requirements(capsys):
    assert main([]) == 0
    assert "requirements: all met" in capsys.readouterr().out


def test_a_missing_site_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--site", str(tmp_path / "absent")])
    assert f"--site: no such folder: {tmp_path / 'absent'}" in capsys.readouterr().err
