"""A dataset row whose prompt does not fit in ``max_context_tokens`` is skipped: counted in
``data/skipped_rows``, and absent from the batch that reaches the experience and train stages (a
2,000-token row there, zero mask or not, cost each forward its time and memory). Through `earl
fit`: in one process, where one step's every row is skipped; and on two processes, where one
rank's rows are all skipped at step 0 and the other's at step 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from earl_lightning.cli import main
from earl_lightning.modules.datamodule import EpisodeDataModule
from tests.e2e.test_resume import scalars
from tests.earl_process import run_earl_process

ROOT = Path(__file__).parents[2]
CONTEXT = 256  # the recipe's max_context_tokens
LONG = "Calculate " + "1" * 2000 + " + 1."  # about 2,000 tokens of the character-level tiny model


def _row(a: int, b: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"Calculate {a} + {b}."}],
        "solution": str(a + b),
    }


def _files(root: Path, rows: list[dict]) -> dict[str, str]:
    files = {"train": root / "train.jsonl", "test": root / "test.jsonl"}
    files["train"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    files["test"].write_text("".join(json.dumps(_row(i, 1)) + "\n" for i in range(2)))
    return {k: str(v) for k, v in files.items()}


def _plays(files: dict[str, str]) -> list[list[tuple[int, int]]]:
    """(group, row index) of the first two steps' episodes, as the run's data module draws them."""
    dm = EpisodeDataModule(
        dataset={"path": "json", "data_files": files, "eval_split": "test"},
        batch_size=4,
        group_size=2,
        seed=0,
        reward_funcs=["trl.rewards.accuracy_reward"],
        eval_episodes=2,
    )
    it = iter(dm.train_dataloader())
    return [[(s.group_id, s.row_index) for s in next(it)["specs"]] for _ in range(2)]


def _dataset(root: Path, long: list[tuple[int, int]]) -> dict[str, str]:
    """Four short rows; then the rows that ``long`` (step, group) play made too long."""
    rows = [_row(i, 2) for i in range(4)]
    plays = _plays(_files(root, rows))
    for step, group in long:
        (index,) = {r for g, r in plays[step] if g == group}
        rows[index] = {**rows[index], "prompt": [{"role": "user", "content": LONG}]}
    return _files(root, rows)


def _per_step(root: Path, tag: str) -> list[float]:
    return [v for _, v in sorted(scalars(root / "run", tag).items())]


def _args(files: dict[str, str], root: Path) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "recipes" / "addition_grpo_warm.yaml"),
        "--model.model",
        "earl-tiny",
        "--data.dataset.data_files",
        json.dumps(files),
        "--data.seed",
        "0",
        "--data.batch_size",
        "4",
        "--data.group_size",
        "2",
        "--data.eval_episodes",
        "2",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
    ]


def test_rows_too_long_for_the_context_never_reach_training(tmp_path):
    """Step 0: the second group's row is too long; step 1: both rows are (nothing trains)."""
    files = _dataset(tmp_path, long=[(0, 1), (1, 0), (1, 1)])
    main(_args(files, tmp_path / "run"))
    assert _per_step(tmp_path, "data/skipped_rows") == [2.0, 4.0]
    context = _per_step(tmp_path, "context/max")
    assert 0 < context[0] <= CONTEXT and context[1] == 0.0, context
    tokens = _per_step(tmp_path, "tokens/total")
    assert 0 < tokens[0] <= 2 * CONTEXT and tokens[1] == 0.0, tokens


@pytest.mark.distributed
def test_a_rank_whose_rows_are_all_skipped_takes_part_on_two_processes(tmp_path):
    """Rollout on two data-parallel ranks, a group each: at step 0 rank 1's row is too long, at
    step 1 rank 0's. The run completes (no collective waits for a rank without rows), and what
    trains is the other rank's group only."""
    from tests.distributed.launch import subprocess_env
    from tests.e2e.test_multiprocess import scalars as all_scalars

    files = _dataset(tmp_path, long=[(0, 1), (1, 0)])
    earl = Path(sys.executable).with_name("earl")
    strategy = "{class_path: earl_lightning.strategies.EarlStrategy, init_args: {layouts: null}}"
    cmd = [str(earl), *_args(files, tmp_path / "run")]
    cmd += ["--trainer.devices", "2", "--trainer.strategy", strategy]
    proc = run_earl_process(
        cmd, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = all_scalars(tmp_path / "run")
    assert s["data/skipped_rows"] == [2.0, 2.0]
    assert all(0 < c <= CONTEXT for c in s["context/max"]), s["context/max"]
    assert all(0 < t <= 2 * CONTEXT for t in s["tokens/total"]), s["tokens/total"]
