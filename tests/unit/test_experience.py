"""ExperienceBatch: packing, selection, validation errors, and the dtype-grouping helpers."""

from __future__ import annotations

import pytest
import torch

from earl_lightning.batches.experience import (
    ExperienceBatch,
    FieldSpec,
    describe_schema,
    group_by_wire_dtype,
    schema_fingerprint,
)
from earl_lightning.dispatch.dispatcher import (
    LENGTHS,
    pack_chunks,
    unpack_chunks,
    wire_bytes_per_row,
)


def make_batch(lengths=(3, 1, 4), seed=0) -> ExperienceBatch:
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    return ExperienceBatch.from_sequences(
        {
            "input_ids": [torch.randint(0, 100, (k,), generator=g) for k in lengths],
            "action_mask": [torch.rand(k, generator=g) > 0.5 for k in lengths],
            "logprobs": [torch.randn(k, generator=g) for k in lengths],
            "values": [torch.randn(k, generator=g).to(torch.bfloat16) for k in lengths],
            "turn_ids": [torch.randint(-5, 5, (k,), generator=g).to(torch.int16) for k in lengths],
        },
        {
            "rewards": torch.randn(n, generator=g, dtype=torch.float64),
            "group_ids": torch.arange(n),
            "episode_ids": torch.arange(n) + 10,
            "truncated": torch.arange(n) % 2 == 0,
        },
    )


def assert_batches_equal(a: ExperienceBatch, b: ExperienceBatch) -> None:
    assert torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert a.schema() == b.schema()
    for k in a.tokens:
        assert torch.equal(a.tokens[k], b.tokens[k]), k
    for k in a.seqs:
        assert torch.equal(a.seqs[k], b.seqs[k]), k


def test_select_and_concat_round_trip():
    b = make_batch()
    parts = [b.select([0]), b.select([1, 2])]
    assert_batches_equal(ExperienceBatch.concat(parts), b)
    picked = b.select([2, 0])
    assert picked.seq_lens.tolist() == [4, 3]
    assert torch.equal(picked.tokens["logprobs"][:4], b.tokens["logprobs"][4:8])


def test_split_by_tokens_respects_the_budget_and_keeps_every_sequence():
    b = make_batch(lengths=(5, 2, 2, 7, 1, 3))
    chunks = b.split_by_tokens(8)
    assert sorted(int(e) for c in chunks for e in c.seqs["episode_ids"]) == list(range(10, 16))
    assert all(c.num_seqs * int(c.seq_lens.max()) <= 8 for c in chunks)


def test_mismatched_token_field_length_is_named():
    with pytest.raises(
        ValueError, match=r"token field 'logprobs' has shape \(3,\), expected \(4,\) to match"
    ):
        ExperienceBatch(
            torch.tensor([0, 4]),
            {"input_ids": torch.zeros(4, dtype=torch.long), "logprobs": torch.zeros(3)},
            {},
        )


def test_mismatched_sequence_field_length_is_named():
    with pytest.raises(
        ValueError, match=r"sequence field 'rewards' has shape \(3,\), expected \(2,\)"
    ):
        ExperienceBatch(torch.tensor([0, 1, 2]), {}, {"rewards": torch.zeros(3)})


def test_nan_reward_names_the_episode():
    b = make_batch()
    rewards = b.seqs["rewards"].clone()
    rewards[1] = float("nan")
    with pytest.raises(ValueError, match=r"reward of episode 11 is nan; rewards must be finite"):
        ExperienceBatch(b.cu_seqlens, b.tokens, {**b.seqs, "rewards": rewards})


def test_schema_orders_token_then_sequence_fields_by_name():
    schema = make_batch().schema()
    assert [(f.kind, f.name) for f in schema] == [
        ("token", "action_mask"),
        ("token", "input_ids"),
        ("token", "logprobs"),
        ("token", "turn_ids"),
        ("token", "values"),
        ("seq", "episode_ids"),
        ("seq", "group_ids"),
        ("seq", "rewards"),
        ("seq", "truncated"),
    ]
    assert "turn_ids[token]:int16" in describe_schema(schema)


def test_group_by_wire_dtype_sends_unsupported_dtypes_as_bytes():
    groups = group_by_wire_dtype(make_batch().schema())
    assert [f.name for f in groups[torch.int64]] == ["input_ids", "episode_ids", "group_ids"]
    assert [f.name for f in groups[torch.uint8]] == [
        "turn_ids"
    ]  # int16 travels as 2 bytes per value
    assert [f.name for f in groups[torch.bfloat16]] == ["values"]
    assert FieldSpec("turn_ids", "token", torch.int16).width == 2


def test_schema_fingerprint_changes_with_dtype_and_kind():
    a = (FieldSpec("x", "token", torch.float32),)
    assert schema_fingerprint(a) == schema_fingerprint((FieldSpec("x", "token", torch.float32),))
    assert schema_fingerprint(a) != schema_fingerprint((FieldSpec("x", "token", torch.float64),))
    assert schema_fingerprint(a) != schema_fingerprint((FieldSpec("x", "seq", torch.float32),))


def test_empty_keeps_the_fields():
    b = make_batch()
    e = ExperienceBatch.empty(b.schema())
    assert e.num_seqs == 0 and e.schema() == b.schema()


def test_pack_unpack_round_trip_is_exact_for_every_dtype():
    b = make_batch(lengths=(3, 1, 4))
    chunks = [[2], [], [0, 2, 1]]
    packed = pack_chunks(b, chunks)
    rows = [len(c) for c in chunks]
    toks = [sum(int(b.seq_lens[i]) for i in c) for c in chunks]
    out = unpack_chunks({dt: buf for dt, (buf, _) in packed.items()}, b.schema(), rows, toks)
    assert_batches_equal(out, b.select([2, 0, 2, 1]))
    token_bytes, seq_bytes = wire_bytes_per_row(b.schema())
    assert token_bytes == 1 + 8 + 4 + 2 + 2 and seq_bytes == 8 + 8 + 8 + 1 + LENGTHS.width * 8
    assert sum(buf.numel() * buf.element_size() for buf, _ in packed.values()) == sum(
        r * seq_bytes + t * token_bytes for r, t in zip(rows, toks)
    )


def _episode(token_ids, mask, turn_starts, turn_rewards, reward, error=None):
    from earl_lightning.rollout.types import Episode, EpisodeSpec

    return Episode(
        spec=EpisodeSpec("recall", 0, 0, 0),
        token_ids=token_ids,
        action_mask=mask,
        logprobs=[0.0] * len(token_ids),
        reward=reward,
        num_turns=len(turn_starts),
        done=True,
        truncated=False,
        invalid_action=False,
        outcome=None,
        error=error,
        turn_starts=turn_starts,
        messages=[],
        turn_rewards=turn_rewards,
    )


def test_turn_token_rewards_by_hand():
    from earl_lightning.batches.episodes import turn_token_rewards

    # prompt 0-1, turn 0 = tokens 2-3, observation 4, turn 1 = token 5, observation 6-7, turn 2 = 8-9
    mask = [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    ep = _episode(list(range(10)), mask, [2, 5, 8], [0.5, -1.0, 2.0], 1.5)
    assert turn_token_rewards(ep, torch.tensor(mask, dtype=torch.float32)).tolist() == [
        0,
        0,
        0,
        0.5,
        0,
        -1.0,
        0,
        0,
        0,
        2.0,
    ]
    # no per-turn rewards (an Episode built by hand): the whole reward on the last generated token
    legacy = _episode(list(range(10)), mask, [2, 5, 8], [], 1.5)
    assert turn_token_rewards(legacy, torch.tensor(mask, dtype=torch.float32)).tolist() == [
        0
    ] * 9 + [1.5]
    # a failed episode's mask is zeroed by episodes_to_experience: nothing to put a reward on
    assert turn_token_rewards(ep, torch.zeros(10)).tolist() == [0.0] * 10
    # turn 1 generated nothing: its reward joins turn 0's on turn 0's last generated token
    quiet = [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    ep = _episode(list(range(10)), quiet, [2, 5, 8], [0.5, -1.0, 2.0], 1.5)
    assert turn_token_rewards(ep, torch.tensor(quiet, dtype=torch.float32)).tolist() == [
        0,
        0,
        0,
        -0.5,
        0,
        0,
        0,
        0,
        0,
        2.0,
    ]
    # nothing generated before the first turn's end: that reward has no token to sit on
    late = [0, 0, 0, 0, 0, 1, 0, 0, 1, 1]
    ep = _episode(list(range(10)), late, [2, 5, 8], [0.5, -1.0, 2.0], 1.5)
    assert turn_token_rewards(ep, torch.tensor(late, dtype=torch.float32)).tolist() == [
        0,
        0,
        0,
        0,
        0,
        -1.0,
        0,
        0,
        0,
        2.0,
    ]


def test_gae_and_reinforce_pp_discount_per_turn_rewards_by_hand():
    from earl_lightning.algorithms.estimators import get_advantage_estimator
    from earl_lightning.batches.episodes import episodes_to_experience
    from earl_lightning.train.advantages import estimate_advantages

    mask = [0, 1, 0, 1, 0, 1]  # three one-token turns at 1, 3, 5
    ep = _episode([0, 1, 2, 3, 4, 5], mask, [1, 3, 5], [0.1, 0.1, 1.0], 1.2)
    exp = episodes_to_experience([ep])
    values = torch.tensor([0.0, 0.2, 0.0, 0.4, 0.0, 0.6])
    exp = type(exp)(exp.cu_seqlens, {**exp.tokens, "values": values}, exp.seqs)
    got = estimate_advantages(
        exp, get_advantage_estimator("gae"), dict(gamma=0.5, lam=1.0), num_groups=1
    )
    g5, g3 = 1.0, 0.1 + 0.5 * 1.0
    g1 = 0.1 + 0.5 * g3  # lambda 1: Monte-Carlo return-to-go minus the value
    torch.testing.assert_close(got.tokens["returns"], torch.tensor([0, g1, 0, g3, 0, g5]))
    torch.testing.assert_close(
        got.tokens["advantages"], torch.tensor([0, g1 - 0.2, 0, g3 - 0.4, 0, g5 - 0.6])
    )
    rpp = estimate_advantages(
        exp, get_advantage_estimator("reinforce_pp"), dict(gamma=0.5), num_groups=1
    )
    rpp = rpp.tokens["advantages"]
    g = torch.tensor([g1, g3, g5])
    torch.testing.assert_close(rpp[[1, 3, 5]], (g - g.mean()) / torch.sqrt(g.var() + 1e-8))


def _masked(masks: list[list[int]], episodes: list[int]) -> ExperienceBatch:
    n = len(masks)
    return ExperienceBatch.from_sequences(
        {
            "input_ids": [torch.arange(len(m)) for m in masks],
            "action_mask": [torch.tensor(m) for m in masks],
        },
        {
            "rewards": torch.zeros(n),
            "group_ids": torch.zeros(n, dtype=torch.long),
            "episode_ids": torch.tensor(episodes),
        },
    )


def test_context_stats_count_what_each_rollout_call_encodes():
    """First prompts and later turns' new tokens, by hand: a multi-turn episode (prompt 4, then
    observations of 3 and 5), a whole-chat episode whose second row continues its first (that
    row's prompt of 6 is a turn), an errored episode (all prompt), and a single-turn one."""
    exp = _masked(
        [
            [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1],
            [0, 0, 1, 1],
            [0, 0, 0, 0, 0, 0, 1],
            [0, 0, 0],
            [0, 0, 0, 0, 0, 1, 1],
        ],
        episodes=[0, 1, 1, 2, 3],
    )
    assert exp.prompt_runs() == (5, 6)
    stats = exp.context_stats()
    assert stats["prompt_max"] == 5 and stats["turn_prefill_max"] == 7  # + the last sampled token
    assert stats["context_max"] == 16 and stats["num_seqs"] == 5
    single = _masked([[0, 0, 0, 1, 1], [0, 1]], episodes=[0, 1])
    assert single.prompt_runs() == (3, 0) and single.context_stats()["turn_prefill_max"] == 0


def test_scored_counts_are_the_action_tokens_after_the_first_position():
    """What the scored last layer runs at, by hand: an action token in position 0 has no logits
    that predict it; a row without actions scores nothing."""
    exp = _masked([[0, 0, 1, 1, 0, 1], [1, 1, 0], [0, 0, 0, 0], [1]], episodes=[0, 1, 2, 3])
    assert exp.scored_counts().tolist() == [3, 1, 0, 0]
    stats = exp.context_stats()
    assert stats["scored_max"] == 3 and stats["scored_share_max"] == pytest.approx(0.5)  # 3 of 6
    assert _masked([[0, 0]], episodes=[0]).context_stats()["scored_share_max"] == 0
