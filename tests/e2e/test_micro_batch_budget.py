"""A fixed layout that names no micro-batch budget runs at the recipe's (`optim.micro_batch_tokens`),
one that names a smaller one at its own: the budget each stage ran with is what the run logs
(`stage/<stage>/micro_batch_tokens`), read from a real fit under EarlStrategy."""

from pathlib import Path

import yaml

from earl_lightning.cli import main
from tests.e2e.test_recipes import smoke_args
from tests.e2e.test_resume import scalars

RECIPES = Path(__file__).parents[2] / "recipes"


def test_fixed_layouts_train_with_the_recipes_budget_or_their_own(tmp_path):
    cfg = yaml.safe_load((RECIPES / "connect4_grpo.yaml").read_text())
    assert cfg["model"]["optim"]["micro_batch_tokens"] == 8192
    cfg["trainer"]["strategy"] = {
        "class_path": "earl_lightning.strategies.EarlStrategy",
        "init_args": {
            "layouts": {
                "experience": {"dp": 1, "tp": 1, "micro_batch_tokens": 1024},
                "train": {"dp": 1, "tp": 1},
            }
        },
    }
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    args = smoke_args(recipe, tmp_path / "run")
    args[args.index("--trainer.max_steps") + 1] = "1"
    main([*args, "--data.eval_episodes", "0"])
    # the train layout names none: the recipe's 8192 (was capped at Layout's 4096)
    assert set(scalars(tmp_path / "run", "stage/train/micro_batch_tokens").values()) == {8192.0}
    # the experience layout names a smaller one: its own
    assert set(scalars(tmp_path / "run", "stage/experience/micro_batch_tokens").values()) == {
        1024.0
    }
