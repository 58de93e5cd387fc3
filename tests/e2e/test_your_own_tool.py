"""docs/your_own_tool.md runs as written, with fewer rows and steps: its tool and reward file, its
rows script, its warm start recipe (`earl sft`) and its GRPO recipe (`earl fit`, every episode
dumped), each `earl` command as the page writes it, and its snippet that reads the dump."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "your_own_tool.md"
EARL = Path(sys.executable).with_name("earl")
# rows of each training file (the page's 4000): one step of the warm start (a batch of at most 32)
# and more rows than the 2 steps x 2 groups of GRPO below play
ROWS = 16
# 2 held-out questions: the evaluation's figures are checked to be there, not their values
SMALL = {
    "sft": ["--trainer.max_epochs", "1", "--data.eval_episodes", "2"],
    "fit": [
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "2",
    ],
}


def files() -> dict[str, str]:
    """The page's files: each code block whose first line is ``# <name>``."""
    found = re.findall(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", PAGE.read_text(), flags=re.S)
    return {name: body for name, body in found}


def commands() -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S):
        out += [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    return out


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` run in ``cwd`` as the user's shell would: an ``earl`` command forked from the
    server that has imported the package (tests/earl_process.py), a ``python`` one started fresh."""
    proc = (run_earl_process if argv[0] == str(EARL) else subprocess.run)(
        argv,
        cwd=cwd,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_the_walkthrough_runs_as_written(tmp_path):
    for name, body in files().items():
        (tmp_path / name).write_text(body)
    assert {"unit_tools.py", "make_unit_rows.py", "unit_sft.yaml", "unit_grpo.yaml"} <= set(files())
    for argv in commands():
        if argv[0] == "python":
            run([sys.executable, *argv[1:], str(ROWS)], tmp_path)
        else:
            assert argv[0] == "earl", argv
            run([str(EARL), *argv[1:], *SMALL[argv[1]]], tmp_path)
    record = json.loads((tmp_path / "runs/unit_sft/model/warm_start.json").read_text())
    assert "first user turn" in record["evaluation_measures"]
    assert {"val/tool_use_rate", "val/rewards/right_number"} <= set(record["evaluation"])
    assert record["demonstrations"]["demo/rows"] == ROWS
    dumped = (tmp_path / "runs/unit_grpo/episodes.jsonl").read_text().splitlines()
    assert len([line for line in dumped if '"phase": "train"' in line]) == 2 * 8
    reader = re.search(r"```python\n(import json\n.*?)```", PAGE.read_text(), flags=re.S).group(1)
    run([sys.executable, "-c", reader], tmp_path)
