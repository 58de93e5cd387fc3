"""`--data.eval_samples n` through the `earl` command: every evaluation (the one before the first
update too) logs val/pass@k and val/mean@n beside the greedy figures, the same draws each time."""

from pathlib import Path

from earl_lightning.cli import main
from tests.e2e.test_recipes import smoke_args
from tests.e2e.test_resume import scalars

RECIPES = Path(__file__).parents[2] / "recipes"


def test_sampled_evaluation_logs_pass_at_k_beside_the_greedy_figure(tmp_path):
    # column digits only: random play, so a row's samples win and lose
    args = smoke_args(RECIPES / "connect4_ppo.yaml", tmp_path)
    main([*args, "--data.eval_samples", "3"])  # a sample passes when it wins (reward 1)
    got = {
        t: scalars(tmp_path, t) for t in ("val/pass@1", "val/pass@2", "val/pass@3", "val/mean@3")
    }
    greedy = scalars(tmp_path, "val/win_rate")
    assert len(greedy) == 2 and min(greedy) == 0  # before the first update and after the second
    for tag, by_step in got.items():
        assert sorted(by_step) == sorted(greedy), tag
    for step in greedy:
        p1, p2, p3 = (got[f"val/pass@{k}"][step] for k in (1, 2, 3))
        assert 0.0 <= p1 <= p2 <= p3 <= 1.0
    assert any(got["val/pass@3"][s] > got["val/pass@1"][s] for s in greedy), got
