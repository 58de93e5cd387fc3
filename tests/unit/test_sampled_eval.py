"""Sampled evaluation (``--data.eval_samples``): pass@k by Chen et al.'s unbiased estimator against
hand-computed cases, the metrics over rows of samples, and the evaluation batch the DataModule
yields. Through the `earl` command: tests/e2e/test_sampled_eval.py."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.algorithms.pass_at_k import pass_at_k
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.sampled_eval import SampledEvalMetrics, pass_ks
from earl_lightning.rollout.types import Episode, EpisodeSpec


def test_pass_at_k_by_hand():
    n = torch.tensor([5, 5, 5, 4, 10, 3])
    c = torch.tensor([2, 0, 3, 1, 3, 3])
    # 1 - C(n - c, k) / C(n, k): C(3,2)/C(5,2) = 3/10; none right; C(2,2)/C(5,2) = 1/10;
    # C(3,2)/C(4,2) = 3/6; C(7,2)/C(10,2) = 21/45; all right
    want = torch.tensor([0.7, 0.0, 0.9, 0.5, 1 - 21 / 45, 1.0], dtype=torch.float64)
    torch.testing.assert_close(pass_at_k(n, c, 2), want)
    # k = 1 is the share right; k = n is "any right"
    torch.testing.assert_close(pass_at_k(n, c, 1), (c / n).double())
    torch.testing.assert_close(
        pass_at_k(torch.tensor([10]), torch.tensor([3]), 5),
        torch.tensor([1 - 21 / 252], dtype=torch.float64),  # C(7,5) / C(10,5)
    )
    with pytest.raises(ValueError, match=r"pass@4 needs 0 <= c <= n and n >= 4 on every row"):
        pass_at_k(torch.tensor([3]), torch.tensor([1]), 4)


def test_reported_k():
    assert pass_ks(1) == [1] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]


def _sample(row: int, j: int, reward: float) -> Episode:
    spec = EpisodeSpec("recall", seed=row, group_id=row, episode_id=row * 4 + j)
    return Episode(spec, [1], [1], [0.0], reward, 1, True, False, False, None, None, [0], [])


def test_metrics_over_rows_of_samples_by_hand():
    rewards = {0: [1.0, 0.0, 0.2, 1.5], 1: [0.0, 0.0, 0.9, 0.0]}  # passing: reward >= 1
    episodes = [_sample(r, j, x) for r, xs in rewards.items() for j, x in enumerate(xs)]
    m = SampledEvalMetrics(4, pass_reward=1.0)
    m.update(episodes[::-1], counted=True)  # order does not matter
    m.update(episodes, counted=False)  # a TP peer's copy adds nothing
    got = m.compute()
    # row 0: 2 of 4 pass; row 1: none
    assert got["val/pass@1"] == pytest.approx(0.25)
    assert got["val/pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # 1 - C(2,2)/C(4,2) for row 0
    assert got["val/pass@4"] == pytest.approx(0.5)
    assert got["val/mean@4"] == pytest.approx(sum(sum(x) for x in rewards.values()) / 8)
    assert set(got) == {"val/pass@1", "val/pass@2", "val/pass@4", "val/mean@4"}
    assert SampledEvalMetrics(0, 1.0).objects() == {}


def test_the_evaluation_batch_holds_the_samples_of_each_row():
    dm = EpisodeDataModule(env="connect_four", eval_episodes=3, eval_samples=2)
    batch = next(iter(dm.val_dataloader()))
    assert [(s.seed, s.group_id, s.episode_id) for s in batch["specs"]] == [
        (0, 0, 0),
        (1, 1, 1),
        (2, 2, 2),
    ]
    assert [(s.seed, s.group_id, s.episode_id) for s in batch["sampled"]] == [
        (0, 0, 0), (0, 0, 1), (1, 1, 2), (1, 1, 3), (2, 2, 4), (2, 2, 5)
    ]  # fmt: skip
    assert next(iter(EpisodeDataModule(eval_episodes=3).val_dataloader()))["sampled"] == []


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(eval_samples=-1), r"`--data.eval_samples` must be an integer >= 0, got -1"),
        (
            dict(eval_pass_reward="high"),
            r"`--data.eval_pass_reward` must be a finite number, got 'high'",
        ),
    ],
)
def test_settings_errors_name_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        EpisodeDataModule(**kw)
