"""What the length limits do to the training signal: a row's completion cut at ``max_new_tokens``
is a truncated episode (what ``algorithm.mask_truncated`` leaves out), and DAPO's soft overlong
punishment (``algorithm.overlong``) by hand."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.algorithms.shaping import overlong_penalty
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules.config import AlgorithmConfig
from earl_lightning.rollout import EpisodeSpec, SamplingConfig, rollout
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.types import Episode
from tests.plugins.scripted import Says

ROW = {"prompt": [{"role": "user", "content": "2+3="}], "answer": "5"}


def test_a_completion_cut_at_max_new_tokens_is_a_truncated_episode():
    tok = load_tokenizer(str(make_tiny_model("earl-tiny")))
    specs = [EpisodeSpec(None, seed=i, group_id=i, episode_id=i, row=ROW) for i in range(2)]
    # a short answer ends with eos ("stop"); one of max_new_tokens characters is cut ("length")
    policies = {0: Says("5"), 1: Says("12345678")}
    eps = rollout(
        specs,
        PolicyBackend(policies, tok),
        tok,
        SamplingConfig(max_new_tokens=8),
        max_turns=1,
        max_context_tokens=512,
    )
    assert [ep.done for ep in eps] == [True, True]
    assert [ep.truncated for ep in eps] == [False, True]


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10.0, 16.0, 17.0, 18.0, 20.0, 25.0])
    got = overlong_penalty(lengths, max_tokens=20, buffer=4, penalty=0.5)
    # 0 up to 20 - 4 = 16, then -0.5 * (L - 16) / 4, and -0.5 from 20 on
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match=r"`buffer` \(30\) must be at most `max_tokens` \(20\)"):
        overlong_penalty(lengths, max_tokens=20, buffer=30)


def _episode(generated: int, error: str | None = None) -> Episode:
    spec = EpisodeSpec(None, seed=0, group_id=0, episode_id=0)
    n = generated + 3
    mask = [0, 0, 0] + [1] * generated
    return Episode(
        spec, [1] * n, mask, [0.0] * n, 1.0, 2, True, False, False, None, error, [3, 4], [],
        turn_rewards=[0.0, 1.0],
    )  # fmt: skip


def test_overlong_shapes_the_reward_and_the_last_turns_reward():
    cfg = AlgorithmConfig(overlong={"max_tokens": 20}).overlong  # buffer: 20 // 5 = 4
    short, long, failed = _episode(10), _episode(18), _episode(20, error="env")
    failed.reward = 0.0
    cfg.apply([short, long, failed])
    assert (short.reward, short.turn_rewards) == (1.0, [0.0, 1.0])
    assert (long.reward, long.turn_rewards) == (0.5, [0.0, 0.5])  # 2 tokens into a buffer of 4
    assert failed.reward == 0.0  # a failed episode trains on nothing and is not shaped
    assert AlgorithmConfig().overlong.on is False


@pytest.mark.parametrize(
    "overlong, match",
    [
        (
            {"buffer": 4},
            r"`--model.algorithm.overlong.buffer` \(4\) is set and "
            r"`--model.algorithm.overlong.max_tokens` is null",
        ),
        (
            {"max_tokens": 8, "buffer": 16},
            r"`--model.algorithm.overlong.buffer` \(16\) must be at most "
            r"`--model.algorithm.overlong.max_tokens` \(8\)",
        ),
        ({"max_tokens": 0}, r"`--model.algorithm.overlong.max_tokens` must be a positive integer"),
        (
            {"max_tokens": 8, "penalty": -1},
            r"`--model.algorithm.overlong.penalty` must be a number >= 0",
        ),
    ],
)
def test_overlong_settings_errors_name_the_flag(overlong, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(overlong=overlong)
