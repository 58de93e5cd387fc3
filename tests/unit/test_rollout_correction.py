"""The rollout correction (``algorithm.rollout_correction``): importance weights pi_old / pi_rollout,
truncated (TIS) or masked (MIS), per token or per sequence; and ``algorithm.mask_truncated``.

With identical log-probs every weight is exactly 1 and the update is bit-identical to one without
the correction; with a planted mismatch, truncation and masking act on exactly the planted tokens
(or rows): the update equals a plain one whose advantages are scaled there, or whose loss leaves
them out."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from earl_lightning.algorithms.correction import RolloutCorrection, get_is_level, get_is_mode
from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.batches.experience import ExperienceBatch
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.modules.config import AlgorithmConfig, OptimConfig, RolloutConfig
from earl_lightning.modules.views import exactly_on_policy, update_view
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.train.forward import fill_logprobs
from earl_lightning.train.loss_weights import add_loss_weights
from earl_lightning.train.update import Models, ppo_update
from tests.updates import reference_update


def correction(level: str, mode: str, low: float | None = None, high: float = 2.0):
    return RolloutCorrection(get_is_level(level), get_is_mode(mode), low, high)


MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_identical_log_probs_give_weights_of_exactly_one(level, mode):
    old = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    got = correction(level, mode, low=0.5).weights(old, old.clone(), MASK)
    assert torch.equal(got.weights, MASK)  # 1 on every generated token, 0 elsewhere
    assert torch.equal(got.keep, MASK.bool()) and torch.equal(got.raw, torch.ones(2, 5))


def _planted() -> tuple[torch.Tensor, torch.Tensor]:
    """Old log-probs and rollout log-probs that differ at (0, 2) by log 3 and at (1, 3) by log 0.25,
    and at (0, 0) (not generated) by 5."""
    old = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    rollout = old.clone()
    rollout[0, 2] -= math.log(3.0)
    rollout[1, 3] -= math.log(0.25)
    rollout[0, 0] -= 5.0
    return old, rollout


def test_token_truncation_clips_only_the_planted_tokens():
    old, rollout = _planted()
    got = correction("token", "truncate").weights(old, rollout, MASK)
    want = MASK.clone()
    want[0, 2] = 2.0  # 3 clipped to high; 0.25 stays (no lower bound)
    want[1, 3] = 0.25
    torch.testing.assert_close(got.weights, want)
    assert torch.equal(got.keep, MASK.bool())
    with_low = correction("token", "truncate", low=0.5).weights(old, rollout, MASK)
    want[1, 3] = 0.5
    torch.testing.assert_close(with_low.weights, want)
    torch.testing.assert_close(got.raw[0, 2], torch.tensor(3.0))


def test_token_masking_drops_only_the_planted_tokens():
    old, rollout = _planted()
    got = correction("token", "mask").weights(old, rollout, MASK)
    keep = MASK.bool().clone()
    keep[0, 2] = False  # above high; 0.25 is kept without a lower bound
    assert torch.equal(got.keep, keep)
    want = MASK.clone()
    want[0, 2], want[1, 3] = 0.0, 0.25
    torch.testing.assert_close(got.weights, want)
    keep[1, 3] = False
    assert torch.equal(correction("token", "mask", low=0.5).weights(old, rollout, MASK).keep, keep)


def test_sequence_level_acts_on_whole_rows():
    old, rollout = _planted()
    rollout[1, 3] = old[1, 3]  # row 1 now equal: its weight is exactly 1
    trunc = correction("sequence", "truncate").weights(old, rollout, MASK)
    torch.testing.assert_close(trunc.weights[0], 2.0 * MASK[0])  # row 0: 3 -> 2 on every token
    assert torch.equal(trunc.weights[1], MASK[1])
    masked = correction("sequence", "mask").weights(old, rollout, MASK)
    assert not masked.keep[0].any() and torch.equal(masked.keep[1], MASK[1].bool())
    assert torch.equal(masked.weights[0], torch.zeros(5))


def test_sequence_weight_is_the_product_of_the_token_ratios():
    old = torch.zeros(1, 4)
    rollout = torch.tensor([[0.0, -0.1, -0.2, 0.05]])
    got = correction("sequence", "truncate", high=10.0).weights(old, rollout, torch.ones(1, 4))
    torch.testing.assert_close(got.weights, torch.full((1, 4), math.exp(0.25)))


# ---- the settings ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rc, match",
    [
        (
            {"level": "tokens"},
            r"unknown `--model.algorithm.rollout_correction.level` 'tokens'; valid "
            r"importance-weight levels: \['sequence', 'token'\]",
        ),
        (
            {"level": "token", "mode": "clip"},
            r"unknown `--model.algorithm.rollout_correction.mode` 'clip'; valid "
            r"importance-weight modes: \['mask', 'truncate'\]",
        ),
        (
            {"level": "token", "high": 0.5},
            r"`--model.algorithm.rollout_correction.high` must be a number >= 1, got 0.5",
        ),
        (
            {"level": "token", "low": 1.5},
            r"`--model.algorithm.rollout_correction.low` must be a number in \[0, 1\]",
        ),
    ],
)
def test_bad_settings_name_the_flag(rc, match):
    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(rollout_correction=rc)


def test_the_correction_turns_the_on_policy_shortcut_off():
    r, o = RolloutConfig(), OptimConfig()
    assert exactly_on_policy(r, AlgorithmConfig(), o)
    on = AlgorithmConfig(rollout_correction={"level": "token"})
    assert not exactly_on_policy(r, on, o)
    view = update_view(r, on, o)
    assert view.correction is not None and not view.on_policy
    assert update_view(r, AlgorithmConfig(), o).correction is None


# ---- through the real update ----------------------------------------------------------------
@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("earl-tiny")
    model, tok = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(str(path))
    specs = [
        EpisodeSpec(
            "recall", seed=i // 2, group_id=i // 2, episode_id=i, env_kwargs={"num_turns": 2}
        )
        for i in range(6)
    ]
    eps = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=3, seed=5),
        max_turns=2,
        max_context_tokens=512,
    )
    exp = fill_logprobs(
        model,
        episodes_to_experience(eps),
        name="old_logprobs",
        temperature=1.0,
        micro_batch_tokens=64,
    )
    adv = torch.randn(exp.num_tokens, generator=torch.Generator().manual_seed(0))
    tokens = {**exp.tokens, "advantages": adv * exp.tokens["action_mask"]}
    # the rollout's log-probs equal to the trainer's: any difference below is planted
    tokens["rollout_logprobs"] = tokens["old_logprobs"].clone()
    return model, ExperienceBatch(exp.cu_seqlens, tokens, exp.seqs)


def _update(model, batch, **cfg):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(list(model.parameters()), lr=0.1)

    class Opt:  # what ppo_update uses of Lightning's optimizer wrapper
        optimizer, param_groups = opt, opt.param_groups
        step, zero_grad = opt.step, opt.zero_grad

    config = reference_update(micro_batch_tokens=64, max_grad_norm=0.0, **cfg)
    out = ppo_update(Models(model), Opt, None, batch, config, Reducer(), lambda x: x.backward())
    return model, out


def _same(a, b, exact: bool = False) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def _moved(a, b) -> bool:
    """Whether two updated models differ (a planted mismatch must change the update)."""
    return any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _with(batch: ExperienceBatch, **tokens) -> ExperienceBatch:
    return ExperienceBatch(batch.cu_seqlens, {**batch.tokens, **tokens}, batch.seqs)


def _first_generated(batch: ExperienceBatch) -> torch.Tensor:
    """[N] bool: the first generated token of every row."""
    act = batch.tokens["action_mask"] > 0
    first = act.clone()
    first[1:] &= ~act[:-1]
    first[batch.cu_seqlens[:-1]] = act[batch.cu_seqlens[:-1]]
    return first


@pytest.mark.parametrize(
    "level, mode", [("token", "truncate"), ("token", "mask"), ("sequence", "mask")]
)
def test_update_with_identical_log_probs_is_bit_identical(setup, level, mode):
    model, batch = setup
    plain, a = _update(model, batch)
    corrected, b = _update(model, batch, correction=correction(level, mode, low=0.5))
    _same(plain, corrected, exact=True)
    assert a["loss/policy"] == b["loss/policy"]
    assert b["rollout_correction/weight_mean"] == 1.0 == b["rollout_correction/weight_max"]
    assert b["rollout_correction/weight_min"] == 1.0 and b["rollout_correction/outside_share"] == 0


def test_update_truncation_scales_the_planted_tokens_advantages(setup):
    model, batch = setup
    planted = _first_generated(batch)
    rollout_lp = batch.tokens["old_logprobs"] - 2.0 * planted  # weight e^2 there, 1 elsewhere
    got, out = _update(
        model, _with(batch, rollout_logprobs=rollout_lp), correction=correction("token", "truncate")
    )
    # the truncated weight 2 multiplies the planted tokens' losses: as if their advantage doubled
    adv = batch.tokens["advantages"] * torch.where(planted, 2.0, 1.0)
    want, _ = _update(model, _with(batch, advantages=adv))
    _same(got, want)
    assert _moved(got, _update(model, batch)[0])
    n = float(batch.tokens["action_mask"].sum())
    assert out["rollout_correction/outside_share"] == pytest.approx(float(planted.sum()) / n)
    assert out["rollout_correction/weight_max"] == pytest.approx(math.exp(2.0), rel=1e-5)


def test_update_masking_leaves_the_planted_tokens_out(setup):
    model, batch = setup
    planted = _first_generated(batch)
    rollout_lp = batch.tokens["old_logprobs"] - 2.0 * planted
    got, _ = _update(
        model, _with(batch, rollout_logprobs=rollout_lp), correction=correction("token", "mask")
    )
    # the same as a loss (and denominators) without those tokens
    act = batch.tokens["action_mask"] * ~planted
    want, _ = _update(model, _with(batch, action_mask=act))
    _same(got, want)
    assert _moved(got, _update(model, batch)[0])


def test_update_sequence_masking_leaves_the_planted_row_out(setup):
    model, batch = setup
    row = batch.token_seq_index() == 1
    # two tokens of row 1 differ by 0.5 each: its sequence weight e^1 > 2; every other row is 1
    planted = _first_generated(batch) & row
    second = torch.roll(planted, 1) & (batch.tokens["action_mask"] > 0) & row
    rollout_lp = batch.tokens["old_logprobs"] - 0.5 * (planted | second).float()
    got, out = _update(
        model, _with(batch, rollout_logprobs=rollout_lp), correction=correction("sequence", "mask")
    )
    want, _ = _update(model, _with(batch, action_mask=batch.tokens["action_mask"] * ~row))
    _same(got, want)
    assert _moved(got, _update(model, batch)[0])
    assert out["rollout_correction/outside_share"] == pytest.approx(
        float((batch.tokens["action_mask"] * row).sum()) / float(batch.tokens["action_mask"].sum())
    )


def test_mask_truncated_leaves_the_truncated_rows_out(setup):
    model, batch = setup
    cut = torch.zeros(batch.num_seqs, dtype=torch.bool)
    cut[[0, 3]] = True
    truncated = ExperienceBatch(batch.cu_seqlens, batch.tokens, {**batch.seqs, "truncated": cut})
    got, out = _update(model, truncated, mask_truncated=True)
    rows = torch.isin(batch.token_seq_index(), torch.tensor([0, 3]))
    want, _ = _update(model, _with(batch, action_mask=batch.tokens["action_mask"] * ~rows))
    _same(got, want)
    assert out["train/truncated_rows_masked"] == 2.0
    weighed, _ = add_loss_weights(truncated, None, True, 64)
    assert torch.equal(weighed.tokens["loss_mask"], batch.tokens["action_mask"] * ~rows)
    assert torch.equal(weighed.tokens["is_weights"], torch.ones(batch.num_tokens))


def test_the_correction_needs_the_old_log_probs(setup):
    _, batch = setup
    tokens = {k: v for k, v in batch.tokens.items() if k != "old_logprobs"}
    with pytest.raises(ValueError, match="the batch has no `old_logprobs`"):
        add_loss_weights(replace(batch, tokens=tokens), correction("token", "mask"), False, 64)
