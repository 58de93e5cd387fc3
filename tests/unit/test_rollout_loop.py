"""The multi-turn rollout loop over the real HF backend and real environments."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from earl_lightning.envs.base import StepResult, register_env
from earl_lightning.envs.recall import RecallEnv
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout

SYSTEM = "Answer with one digit."


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


@register_env("_test_flaky")
class FlakyEnv(RecallEnv):
    """Recall that raises in ``step`` on turn ``fail_turn`` (or in ``reset``) for one seed."""

    def __init__(self, fail_seed: int = -1, fail_turn: int = 1, fail_reset: bool = False, **kw):
        super().__init__(**kw)
        self.fail_seed, self.fail_turn, self.fail_reset = fail_seed, fail_turn, fail_reset

    def reset(self, seed: int) -> str:
        self.seed = seed
        if self.fail_reset and seed == self.fail_seed:
            raise OSError("reset broke")
        return super().reset(seed)

    def step(self, action: str) -> StepResult:
        if self.seed == self.fail_seed and self._turn == self.fail_turn:
            raise RuntimeError("boom")
        return super().step(action)


def _specs(n: int, env: str = "recall", **env_kwargs) -> list[EpisodeSpec]:
    kw = dict(num_turns=4, padding_chars=12) | env_kwargs
    return [
        EpisodeSpec(env, seed=100 + i, group_id=i // 2, episode_id=i, env_kwargs=kw)
        for i in range(n)
    ]


def _run(lm, specs, sampling, **kw):
    model, tok = lm
    kw = dict(max_turns=6, max_context_tokens=4096, system_prompt=SYSTEM) | kw
    return rollout(specs, HFBackend(model, tok), tok, sampling, **kw)


def _ids(tok, messages):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))


def test_tokens_are_the_chat_template_of_the_transcript(lm):
    _, tok = lm
    sampling = SamplingConfig(max_new_tokens=24, seed=0, temperature=1.5)
    episodes = _run(lm, _specs(8), sampling)
    reasons = set()
    for ep in episodes:
        assert ep.done and not ep.truncated and ep.error is None and ep.num_turns == 4
        assert ep.messages[0] == {"role": "system", "content": SYSTEM}
        assert [m["role"] for m in ep.messages[1:]] == ["user", "assistant"] * 4
        assert _ids(tok, ep.messages) == ep.token_ids
        assert tok.decode(ep.token_ids) == tok.apply_chat_template(ep.messages, tokenize=False)
        assert len(ep.token_ids) == len(ep.action_mask) == len(ep.logprobs)
        for start in ep.turn_starts:
            end = start + ep.action_mask[start:].index(0)
            reasons.add("eos" if ep.token_ids[end - 1] == tok.eos_token_id else "length")
    assert reasons == {
        "eos",
        "length",
    }  # both closing paths (append "\n" vs "<|im_end|>\n") exercised


def test_action_mask_covers_exactly_the_generated_tokens(lm):
    _, tok = lm
    episodes = _run(lm, _specs(6), SamplingConfig(max_new_tokens=24, seed=1, temperature=1.5))
    for ep in episodes:
        turns = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        masked = [i for i, m in enumerate(ep.action_mask) if m]
        spans = []
        for k, start in enumerate(ep.turn_starts):
            end = start + ep.action_mask[start:].index(0)
            spans += range(start, end)
            ids = ep.token_ids[start:end]
            if ids[-1] == tok.eos_token_id:
                ids = ids[:-1]
            assert tok.decode(ids, skip_special_tokens=False) == turns[k]
        assert masked == spans  # nothing but generated tokens is masked in
        assert sum(ep.action_mask) == ep.num_generated
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.action_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(ep.logprobs, ep.action_mask) if m)


def test_rollout_logprobs_equal_a_full_forward(lm):
    """The check the trainer relies on: sampled log-probs == a fresh forward of the final episode."""
    model, tok = lm
    temperature = 0.9
    episodes = _run(
        lm,
        _specs(6, num_turns=5),
        SamplingConfig(max_new_tokens=10, seed=2, temperature=temperature),
    )
    worst = 0.0
    for ep in episodes:
        ids = torch.tensor([ep.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, -1)
        recomputed = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        mask = torch.tensor(ep.action_mask[1:], dtype=torch.bool)
        got = torch.tensor(ep.logprobs[1:])
        worst = max(worst, float((recomputed - got)[mask].abs().max()))
    assert worst < 1e-4


def test_max_turns_truncates(lm):
    episodes = _run(
        lm, _specs(3, num_turns=5), SamplingConfig(max_new_tokens=4, seed=0), max_turns=3
    )
    for ep in episodes:
        assert ep.truncated and not ep.done and ep.num_turns == 3 and ep.error is None
        assert ep.messages[-1]["role"] == "assistant"


def test_max_context_tokens_truncates_exactly(lm):
    _, tok = lm
    sampling = SamplingConfig(max_new_tokens=6, greedy=True)
    full = _run(lm, _specs(1, num_turns=6), sampling)[0]
    assert full.done and full.num_turns == 6
    # Turn k starts with a context of turn_starts[k] tokens and needs max_new_tokens more.
    fits_three = full.turn_starts[2] + 6
    for limit, turns in [(fits_three, 3), (fits_three - 1, 2)]:
        ep = _run(lm, _specs(1, num_turns=6), sampling, max_context_tokens=limit)[0]
        assert ep.truncated and not ep.done and ep.num_turns == turns
        assert ep.token_ids == full.token_ids[: len(ep.token_ids)]
        assert _ids(tok, ep.messages) == ep.token_ids
        assert max(ep.turn_starts) + 6 <= limit


def test_first_observation_too_long_raises(lm):
    with pytest.raises(
        ValueError,
        match=r"`max_context_tokens`=40 is too small: .*episode 0 \(env 'recall'\) "
        r"needs \d+ tokens \(\d+ prompt \+ 6 max_new_tokens\)",
    ):
        _run(lm, _specs(2), SamplingConfig(max_new_tokens=6), max_context_tokens=40)


def test_env_exception_fails_only_that_episode(lm):
    sampling = SamplingConfig(max_new_tokens=6, seed=4)
    specs = _specs(4, env="_test_flaky", fail_seed=102, fail_turn=2)
    clean = _run(lm, _specs(4, env="_test_flaky"), sampling)
    episodes = _run(lm, specs, sampling)
    bad = episodes[2]
    assert bad.error == "env '_test_flaky' (seed 102): step() raised RuntimeError('boom')"
    assert bad.done and bad.reward == 0.0
    assert bad.num_turns == 3 and bad.token_ids == clean[2].token_ids[: len(bad.token_ids)]
    for ep, ref in zip(episodes, clean):
        if ep is not bad:
            assert ep.error is None and ep.token_ids == ref.token_ids and ep.reward == ref.reward


def test_reset_exception_fails_only_that_episode(lm):
    specs = _specs(3, env="_test_flaky", fail_seed=101, fail_reset=True)
    episodes = _run(lm, specs, SamplingConfig(max_new_tokens=4, seed=0))
    assert (
        episodes[1].error == "env '_test_flaky' (seed 101): reset() raised OSError('reset broke')"
    )
    assert episodes[1].done
    assert episodes[1].token_ids == [] and episodes[1].num_turns == 0
    assert all(ep.error is None and ep.num_turns == 4 for ep in (episodes[0], episodes[2]))


def test_rewards_sum_step_rewards(lm):
    episodes = _run(
        lm, _specs(8, num_turns=4, lag=0), SamplingConfig(max_new_tokens=3, seed=7, temperature=2.0)
    )
    for ep in episodes:
        shown = [
            int(m["content"].split("Digit: ")[1][0]) for m in ep.messages if m["role"] == "user"
        ]
        answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        correct = sum(
            1
            for d, a in zip(shown, answers)
            if any(c.isdigit() for c in a) and [c for c in a if c.isdigit()][0] == str(d)
        )
        assert ep.reward == pytest.approx(correct / 4)


def test_backend_cache_is_released(lm):
    model, tok = lm
    backend = HFBackend(model, tok)
    rollout(
        _specs(3),
        backend,
        tok,
        SamplingConfig(max_new_tokens=4, seed=0),
        max_turns=2,
        max_context_tokens=2048,
    )
    assert backend.cached_keys() == []


def test_kv_and_reprefill_rollouts_are_identical(lm):
    model, tok = lm
    sampling = SamplingConfig(max_new_tokens=8, seed=9)
    specs = _specs(5, num_turns=5)
    a = rollout(specs, HFBackend(model, tok), tok, sampling, max_turns=5, max_context_tokens=4096)
    b = rollout(
        specs,
        HFBackend(model, tok, reuse_kv=False),
        tok,
        sampling,
        max_turns=5,
        max_context_tokens=4096,
    )
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.action_mask == y.action_mask
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_turns=0), r"`max_turns` must be a positive integer, got 0"),
        (dict(max_context_tokens=0), r"`max_context_tokens` must be a positive integer, got 0"),
    ],
)
def test_argument_errors(lm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _run(lm, _specs(1), SamplingConfig(), **kwargs)


def test_duplicate_episode_ids_and_unknown_env(lm):
    specs = _specs(2)
    specs[1].episode_id = 0
    with pytest.raises(
        ValueError, match=r"`specs` must have unique `episode_id`s .*duplicated: \[0\]"
    ):
        _run(lm, specs, SamplingConfig())
    with pytest.raises(ValueError, match=r"unknown `env` 'nope'; valid environments: \[.*'recall'"):
        _run(lm, [EpisodeSpec("nope", 0, 0, 0)], SamplingConfig())


def test_turn_rewards_are_each_steps_reward_and_sit_on_each_turns_last_generated_token(lm):
    from earl_lightning.batches.episodes import episodes_to_experience

    _, tok = lm
    digits = [
        tok.convert_tokens_to_ids(str(d)) for d in range(10)
    ]  # so that some answers are right
    sampling = SamplingConfig(max_new_tokens=1, seed=7, temperature=2.0, allowed_token_ids=digits)
    episodes = _run(lm, _specs(8, num_turns=4, lag=0), sampling)
    exp = episodes_to_experience(episodes)
    for i, ep in enumerate(episodes):
        assert len(ep.turn_rewards) == ep.num_turns == 4
        assert sum(ep.turn_rewards) == pytest.approx(ep.reward)
        shown = [
            int(m["content"].split("Digit: ")[1][0]) for m in ep.messages if m["role"] == "user"
        ]
        answers = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        for r, d, a in zip(ep.turn_rewards, shown, answers):
            digits = [c for c in a if c.isdigit()]
            assert r == (0.25 if digits and digits[0] == str(d) else 0.0)
        row = exp.tokens["token_rewards"][exp.cu_seqlens[i] : exp.cu_seqlens[i + 1]].tolist()
        ends = [*ep.turn_starts[1:], len(ep.token_ids)]
        expected = [0.0] * len(ep.token_ids)
        for start, end, r in zip(ep.turn_starts, ends, ep.turn_rewards):
            last = max(t for t in range(start, end) if ep.action_mask[t])
            expected[last] = r
        assert row == pytest.approx(expected)
    assert any(0 < sum(ep.turn_rewards) < 1 for ep in episodes)  # rewards of some turns, not all


def test_failed_episode_has_zero_turn_rewards(lm):
    specs = _specs(4, env="_test_flaky", fail_seed=102, fail_turn=2, lag=0)
    bad = _run(lm, specs, SamplingConfig(max_new_tokens=3, seed=4))[2]
    assert bad.error is not None and bad.turn_rewards == [0.0, 0.0, 0.0]


def test_chat_deltas_remember_renders_and_encodings_within_a_rollout():
    """A group's episodes start from one prompt: it is rendered and encoded once; the results equal
    the tokenizer's own, and a message with unhashable values is rendered without the memo."""
    from earl_lightning.models import load_tokenizer, make_tiny_model
    from earl_lightning.rollout.chat import ChatDeltas

    tok = load_tokenizer(str(make_tiny_model("earl-tiny")))
    chat = ChatDeltas(tok)
    calls = []
    real = chat._render

    def counting(*a):
        calls.append(1)
        return real(*a)

    chat._render = counting
    msgs = [{"role": "user", "content": "board: ..x.."}]
    texts = [chat.prompt(list(msgs)) for _ in range(8)]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert len(calls) == 1 and texts == [want] * 8
    ids = [chat.encode(texts[0]) for _ in range(3)]
    assert ids == [list(tok.encode(texts[0], add_special_tokens=False))] * 3
    ids[0].append(-1)  # callers may extend what they get; the memo is not touched
    assert chat.encode(texts[0]) == ids[1]
    odd = [{"role": "user", "content": "x", "parts": ["a", "b"]}]
    chat.render(odd, generation_prompt=True)
    chat.render(odd, generation_prompt=True)
    assert len(calls) == 3
