"""`earl fit ... --ckpt_path last` after an interrupted run ends where an uninterrupted run ends."""

from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from earl_lightning.cli import main

RECIPES = Path(__file__).parents[2] / "recipes"
RECIPE = RECIPES / "connect4_ppo.yaml"  # the default: value head, turn rows, allowed tokens


def recipe_checkpointing_every_step(tmp_path: Path, recipe: Path = RECIPE) -> Path:
    cfg = yaml.safe_load(recipe.read_text())
    cfg["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"save_last": True, "every_n_train_steps": 1},
        }
    ]
    out = tmp_path / "recipe.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def args(recipe, root, steps, *extra):
    return [
        "fit",
        "--config",
        str(recipe),
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.val_check_interval",
        "100",
        "--trainer.limit_val_batches",
        "0",
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "0",
        *extra,
    ]


def scalars(root: Path, tag: str) -> dict[int, float]:
    out = {}
    for ev in sorted(root.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(ev))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def last_state(root: Path) -> dict:
    ckpt = max(root.rglob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return torch.load(ckpt, map_location="cpu", weights_only=False)


@pytest.mark.parametrize(
    "name, strategy",
    [("connect4_ppo", "auto"), ("connect4_ppo", "earl"), ("connect4_grpo", "auto")],
)
def test_resume_matches_uninterrupted_run(tmp_path, name, strategy):
    full, part = tmp_path / "full", tmp_path / "part"
    recipe = recipe_checkpointing_every_step(tmp_path, RECIPES / f"{name}.yaml")
    extra = ("--trainer.strategy", strategy)
    if name == "connect4_ppo":
        # one game group of 4 a step, not 2: the value head's advantages need no group, and the
        # resume restores the same state (weights, Adam's moments, the data's and the games' RNG).
        # GRPO keeps 2 groups: its group-centred advantages of one group could all be 0.
        extra += ("--data.batch_size", "4")
    main(args(recipe, full, 4, *extra))
    main(args(recipe, part, 2, *extra))
    main(args(recipe, part, 4, "--ckpt_path", "last", *extra))
    a, b = last_state(full), last_state(part)
    assert a["global_step"] == b["global_step"] == 4
    assert a["earl"]["rl_iteration"] == b["earl"]["rl_iteration"] == 4
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(
            b["state_dict"][k], v, rtol=0, atol=0, msg=f"parameter {k} differs"
        )
    ra, rb = scalars(full, "reward/mean"), scalars(part, "reward/mean")
    assert set(ra) == set(rb) and len(ra) == 4
    # the relaunch's own logs start at step 2
    resumed = max((part / "lightning_logs").glob("version_*"))
    assert sorted(scalars(resumed, "reward/mean")) == [2, 3], (
        "the relaunch did not resume from the checkpoint"
    )
    for step in ra:
        assert ra[step] == rb[step], f"reward/mean differs at step {step}"


def test_checkpoint_holds_each_weight_once_and_validates(tmp_path):
    """`earl validate --ckpt_path` loads a training checkpoint (no stray copies of the policy)."""
    recipe = recipe_checkpointing_every_step(tmp_path)
    main(args(recipe, tmp_path / "run", 1))
    state = last_state(tmp_path / "run")
    keys = sorted(state["state_dict"])
    assert all(k.startswith(("policy.", "value_head.")) for k in keys), keys[:5]
    assert {"value_head.weight", "value_head.bias"} <= set(keys)
    ckpt = max((tmp_path / "run").rglob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    main(
        [
            "validate",
            "--config",
            str(recipe),
            "--ckpt_path",
            str(ckpt),
            "--trainer.default_root_dir",
            str(tmp_path / "val"),
            "--trainer.enable_progress_bar",
            "false",
            "--data.eval_episodes",
            "4",
        ]
    )
