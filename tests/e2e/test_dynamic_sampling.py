"""Dynamic sampling through the `earl` command: an interrupted run resumed with `--ckpt_path last`
ends bit-identical to an uninterrupted one (each step's further draws are keyed by the seed, the
step and the draw), and the groups drawn and dropped are logged."""

from pathlib import Path

import torch

from earl_lightning.cli import main
from tests.e2e.test_resume import args, last_state, recipe_checkpointing_every_step, scalars

RECIPES = Path(__file__).parents[2] / "recipes"
DRAWS = ("--model.algorithm.dynamic_sampling.max_draws", "3")


def test_dynamic_sampling_resumes_bit_identical(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    recipe = recipe_checkpointing_every_step(tmp_path, RECIPES / "connect4_grpo.yaml")
    main(args(recipe, full, 4, *DRAWS))
    main(args(recipe, part, 2, *DRAWS))
    main(args(recipe, part, 4, "--ckpt_path", "last", *DRAWS))
    a, b = last_state(full), last_state(part)
    assert a["global_step"] == b["global_step"] == 4
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=0, atol=0, msg=f"{k} differs")
    resumed = max((part / "lightning_logs").glob("version_*"))
    assert sorted(scalars(resumed, "reward/mean")) == [2, 3], "the relaunch did not resume"
    for tag in ("dynamic_sampling/groups_dropped", "dynamic_sampling/draws", "reward/mean"):
        assert scalars(full, tag) == scalars(part, tag), tag
    drawn, dropped = (
        scalars(full, "dynamic_sampling/groups_drawn"),
        scalars(full, "dynamic_sampling/groups_dropped"),
    )
    # 2 groups a step: every draw plays 2, and the batch keeps 2
    assert all(drawn[s] - dropped[s] == 2 for s in drawn) and len(drawn) == 4
    assert sum(dropped.values()) > 0, "no group was replaced: the test would not cover the draws"
