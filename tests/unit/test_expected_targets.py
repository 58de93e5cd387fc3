"""Expected (soft) demonstration targets: a policy that states its distribution has each turn's
first token trained on it. The loss equals the probability-weighted mean of the plain SFT losses
of the alternatives (values and gradients), reduces to Hugging Face's labels loss without soft
targets, and the targets recorded while playing are the policy's distribution on exactly the
token the transcript labels."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.algorithms.supervised import soft_token_cross_entropy
from earl_lightning.batches.episodes import supervised_rows
from earl_lightning.envs.openspiel_env import legal_from_observation
from earl_lightning.models import load_model, load_tokenizer
from earl_lightning.rollout.backends.base import SamplingConfig
from earl_lightning.rollout.demonstrations import (
    DemonstrationError,
    play_demonstrations_with_targets,
)
from earl_lightning.rollout.types import EpisodeSpec
from earl_lightning.sft.datamodule import SoftTargetCollator, training_rows

DIGITS = [str(d) for d in range(7)]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("earl-tiny").eval(), load_tokenizer("earl-tiny")


def _digits(tok):
    return [tok.encode(d, add_special_tokens=False)[0] for d in DIGITS]


def _connect_four(tok, history, n=6, policy="random_legal"):
    specs = [
        EpisodeSpec(
            "connect_four", seed=s, group_id=s, episode_id=s, env_kwargs={"opponent": "random"}
        )
        for s in range(n)
    ]
    return play_demonstrations_with_targets(
        specs,
        policy,
        None,
        tok,
        SamplingConfig(max_new_tokens=1, allowed_token_ids=_digits(tok)),
        max_turns=21,
        max_context_tokens=4096,
        history_turns=history,
    )


def test_without_soft_targets_the_loss_is_the_hf_labels_loss(tiny):
    model, _ = tiny
    ids = torch.randint(3, 40, (3, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 9:] = -100
    logits = model(input_ids=ids).logits
    assert torch.allclose(
        soft_token_cross_entropy(logits, labels),
        model(input_ids=ids, labels=labels).loss,
        atol=1e-6,
    )


def test_a_soft_target_replaces_that_positions_loss_only(tiny):
    model, _ = tiny
    ids = torch.randint(3, 40, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100
    q = {7: 0.5, 11: 0.3, 13: 0.2}
    soft = dict(
        soft_rows=torch.tensor([1]),
        soft_pos=torch.tensor([6]),
        soft_owner=torch.tensor([0, 0, 0]),
        soft_tokens=torch.tensor(list(q)),
        soft_probs=torch.tensor(list(q.values())),
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logp = logits[1, 5].log_softmax(-1)  # position 5 predicts token 6
    n = float((labels[:, 1:] != -100).sum())
    expected = (
        soft_token_cross_entropy(logits, labels)
        + (logp[labels[1, 6]] - sum(p * logp[t] for t, p in q.items())) / n
    )
    assert torch.allclose(soft_token_cross_entropy(logits, labels, **soft), expected, atol=1e-6)


def test_one_token_turn_rows_make_the_soft_loss_the_exact_mixture(tiny):
    """A one-token action at the end of its row (history_turns 0): nothing after it, so the soft
    loss and gradients equal the probability-weighted plain losses and gradients exactly."""
    model, _ = tiny
    ids = torch.randint(3, 40, (2, 9))
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    q = {7: 0.25, 11: 0.75}
    soft = dict(
        soft_rows=torch.tensor([0]),
        soft_pos=torch.tensor([8]),
        soft_owner=torch.tensor([0, 0]),
        soft_tokens=torch.tensor(list(q)),
        soft_probs=torch.tensor(list(q.values())),
    )
    model.zero_grad()
    soft_loss = soft_token_cross_entropy(model(input_ids=ids).logits, labels, **soft)
    soft_loss.backward()
    soft_grads = [p.grad.clone() for p in model.parameters()]
    mix_loss, mix_grads = 0.0, [torch.zeros_like(p) for p in model.parameters()]
    for token, p in q.items():
        ids_k, labels_k = ids.clone(), labels.clone()
        ids_k[0, 8] = labels_k[0, 8] = token
        model.zero_grad()
        loss_k = soft_token_cross_entropy(model(input_ids=ids_k).logits, labels_k)
        loss_k.backward()
        mix_loss += p * loss_k.detach()
        mix_grads = [m + p * q_.grad for m, q_ in zip(mix_grads, model.parameters())]
    assert torch.allclose(soft_loss.detach(), mix_loss, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(soft_grads, mix_grads))


def test_a_soft_target_on_an_unlabelled_position_is_refused(tiny):
    model, _ = tiny
    ids = torch.randint(3, 40, (1, 6))
    labels = torch.full_like(ids, -100)
    labels[0, 5] = ids[0, 5]
    with pytest.raises(ValueError, match="not labelled"):
        soft_token_cross_entropy(
            model(input_ids=ids).logits,
            labels,
            torch.tensor([0]),
            torch.tensor([3]),
            torch.tensor([0]),
            torch.tensor([5]),
            torch.tensor([1.0]),
        )


@pytest.mark.parametrize("history", [0, None])
def test_random_legal_targets_are_uniform_over_the_legal_columns_on_the_labelled_token(
    tiny, history
):
    _, tok = tiny
    episodes, targets = _connect_four(tok, history)
    digit = dict(zip(_digits(tok), range(7)))
    rows = supervised_rows(episodes)
    checked = 0
    for ep, ep_rows, ep_targets in zip(episodes, rows, targets):
        observations = [m["content"] for m in ep.messages if m["role"] == "user"]
        assert len(ep_targets) == ep.num_turns
        for row in ep_rows:
            for k, pos in row.heads:
                legal = legal_from_observation(observations[k])
                assert row.action_mask[pos] == 1 and (pos == 0 or row.action_mask[pos - 1] == 0)
                assert {digit[t] for t in ep_targets[k]} == set(legal)
                assert all(abs(p - 1 / len(legal)) < 1e-9 for p in ep_targets[k].values())
                assert digit[row.input_ids[pos]] in legal  # the played move is one of them
                checked += 1
    assert checked == sum(ep.num_turns for ep in episodes) and checked > 30


def test_training_rows_and_collator_carry_the_targets_to_their_positions(tiny):
    _, tok = tiny
    episodes, targets = _connect_four(tok, 0, n=3)
    rows = training_rows(episodes, targets, expected=True)
    assert all(len(r["soft"]) == 1 for r in rows)
    assert not any(r["soft"] for r in training_rows(episodes, targets, expected=False))
    batch = SoftTargetCollator(tok.pad_token_id)(rows[:5])
    for n, (row, pos) in enumerate(zip(batch["soft_rows"].tolist(), batch["soft_pos"].tolist())):
        assert batch["labels"][row, pos] == rows[row]["input_ids"][pos] != -100
        entries = batch["soft_owner"] == n
        assert torch.isclose(batch["soft_probs"][entries].sum(), torch.tensor(1.0))
    centre = training_rows(*_connect_four(tok, 0, n=2, policy="centre_first"), expected=True)
    assert not any(r["soft"] for r in centre)  # a policy without a distribution: plain labels


class StatesBadDistribution:
    def __init__(self, seed: int = 0, kind: str = "sum") -> None:
        self.kind = kind

    def __call__(self, observation: str) -> str:
        return "3"

    def distribution(self, observation: str):
        return {"sum": {"3": 0.5, "4": 0.2}, "zero": {"4": 1.0}, "type": [("3", 1.0)]}[self.kind]


@pytest.mark.parametrize(
    "kind, message",
    [
        (
            "sum",
            r"distribution for the observation .* sums to 0.7; its probabilities must sum to 1",
        ),
        ("zero", r"gives the action it played, '3', probability 0"),
        ("type", r"must be a non-empty mapping of action strings to probabilities >= 0"),
    ],
)
def test_a_bad_distribution_is_refused_with_the_policy_named(tiny, kind, message):
    _, tok = tiny
    specs = [EpisodeSpec("connect_four", seed=0, group_id=0, episode_id=0)]
    with pytest.raises(
        DemonstrationError,
        match=r"policy 'tests.unit.test_expected_targets.StatesBadDistribution'.*" + message,
    ):
        play_demonstrations_with_targets(
            specs,
            "tests.unit.test_expected_targets.StatesBadDistribution",
            {"kind": kind},
            tok,
            SamplingConfig(max_new_tokens=1, allowed_token_ids=_digits(tok)),
            max_turns=2,
            max_context_tokens=1024,
        )
