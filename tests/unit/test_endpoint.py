"""The agents' endpoint driven by the real ``openai`` SDK (no mocks): the rows an episode trains on
are the ids the server sampled, with exact masks and log-probs; a call that continues the
conversation extends its row and one that rewrites it starts a new row with the same reward; tool
calls come back as OpenAI ``tool_calls``; pending calls are batched; bad requests get OpenAI-style
errors and the rollout goes on; an agent that raises, hangs or returns no reward fails only its
episode."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM

from earl_lightning.batches.episodes import episodes_to_experience
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig
from earl_lightning.rollout.endpoint import EndpointServer, agent_rollout
from earl_lightning.rollout.scoring import transcript
from earl_lightning.tasks.tool_parsers import hermes
from tests.plugins import agents as plugin
from tests.plugins.agents import ADD, ScriptedBackend, call


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(make_tiny_model("earl-tiny")))


@pytest.fixture(scope="module")
def server():
    server = EndpointServer("earl-tiny").start()
    yield server
    server.close()


def specs(rows):
    return [
        EpisodeSpec(None, seed=i, group_id=i, episode_id=i, row=row, row_index=i)
        for i, row in enumerate(rows)
    ]


def play(server, tok, agent, rows, backend, **kw):
    kw = dict(max_turns=8, max_context_tokens=4096, parser=hermes) | kw
    sampling = kw.pop("sampling", SamplingConfig(max_new_tokens=128, seed=3))
    return agent_rollout(specs(rows), backend, tok, sampling, agent=agent, server=server, **kw)


def scripted(tok, *scripts):
    return ScriptedBackend(dict(enumerate(scripts)), tok)


# ---- the rows are the sampled ids ------------------------------------------------------------------


def test_rows_are_the_ids_the_server_sampled(server, tok):
    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_model("earl-tiny")))
    rows = [{"prompt": f"question {i}"} for i in range(3)]
    plugin.chat.seen.clear()
    backend = HFBackend(model, tok)
    episodes = play(
        server, tok, plugin.chat, rows, backend, sampling=SamplingConfig(max_new_tokens=12, seed=7)
    )
    for ep, row in zip(episodes, rows):
        r1, r2, r3 = plugin.chat.seen[row["prompt"]]
        assert ep.error is None and ep.reward == 1.0 and ep.num_turns == 3
        assert ep.row_starts is not None and len(ep.row_starts) == 1, (
            "the summary call is a new row"
        )
        start = ep.row_starts[0]
        for r, at in zip((r1, r2, r3), ep.turn_starts):
            prompt, sampled = r.prompt_token_ids, r.choices[0].token_ids
            base = 0 if at < start else start
            assert ep.token_ids[base:at] == prompt, (
                "the prompt the server sampled from is the row's"
            )
            assert ep.token_ids[at : at + len(sampled)] == sampled
            assert ep.action_mask[at : at + len(sampled)] == [1] * len(sampled)
        lps = [x.logprob for x in r1.choices[0].logprobs.content]
        at = ep.turn_starts[0]
        assert ep.logprobs[at : at + len(lps)] == pytest.approx(lps)
        generated = sum(len(r.choices[0].token_ids) for r in (r1, r2, r3))
        assert sum(ep.action_mask) == generated, "mask 1 on the sampled tokens, nowhere else"
        second = r2.prompt_token_ids
        assert second[: len(r1.prompt_token_ids) + len(r1.choices[0].token_ids)] == (
            r1.prompt_token_ids + r1.choices[0].token_ids
        ), "the continuing call is the first call's ids, then the sampled ids, never re-tokenized"
    assert backend.stats["reused_tokens"] > 0, "a continuing call reuses its row's KV cache"
    batch = episodes_to_experience(episodes)
    assert batch.seqs["turn_index"].tolist() == [0, 1] * 3
    assert batch.seqs["rewards"].tolist() == [1.0] * 6, "both rows carry the episode's reward"


def test_tool_calls_come_back_as_openai_tool_calls_and_the_row_is_the_templates_render(server, tok):
    backend = scripted(tok, [call("add", a=2, b=3), "5"])
    (ep,) = play(server, tok, plugin.tool_user, [{"prompt": "What is 2+3?"}], backend)
    assert ep.error is None and ep.reward == 1.0 and ep.num_turns == 2 and ep.tool_calls == 1
    assert ep.row_starts is None, "the tool result continues the conversation: one row"
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[1]["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": {"a": 2, "b": 3},
    }
    rendered = [
        ep.messages[0],
        {"role": "assistant", "content": call("add", a=2, b=3)},
        ep.messages[2],
        {"role": "assistant", "content": "5"},
    ]
    assert tok.decode(ep.token_ids) == tok.apply_chat_template(
        rendered, tools=[ADD], tokenize=False
    )
    generated = tok.decode([t for t, m in zip(ep.token_ids, ep.action_mask) if m])
    assert generated == call("add", a=2, b=3) + "<|im_end|>5<|im_end|>", "the tool result is masked"
    prompt, completion, _ = transcript(ep, tok)
    assert prompt == "What is 2+3?" and completion == "5"


def test_the_openai_agents_sdk_runs_unchanged_against_the_endpoint(server, tok):
    backend = scripted(tok, [call("add", a=2, b=3), "5"])
    (ep,) = play(server, tok, plugin.agents_sdk, [{"prompt": "What is 2+3?"}], backend)
    assert ep.error is None and ep.reward == 1.0 and ep.num_turns == 2 and ep.tool_calls == 1
    assert ep.row_starts is None, "the SDK sends the conversation back as it got it: one row"
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
    generated = tok.decode([t for t, m in zip(ep.token_ids, ep.action_mask) if m])
    assert generated == call("add", a=2, b=3) + "<|im_end|>5<|im_end|>"


def test_the_calls_pending_at_each_moment_are_one_generation(server, tok):
    backend = scripted(tok, *[["hello"]] * 8)
    # a long wait for stragglers: the batch closes when every running agent has a call pending
    # (under load an agent can take longer than the default 50 ms between two calls)
    rows = [{"prompt": f"q{i}"} for i in range(8)]
    play(server, tok, plugin.chat, rows, backend, batch_wait_s=30.0)
    assert [len(keys) for keys in backend.calls] == [8, 8, 8]


def test_a_plain_def_agent_gets_the_sync_client_and_its_columns(server, tok):
    backend = scripted(tok, ["7"], ["8"])
    eps = play(server, tok, plugin.sync_agent, [{"prompt": "3+4", "answer": 7}] * 2, backend)
    assert [ep.reward for ep in eps] == [1.0, 0.0] and all(ep.error is None for ep in eps)


# ---- faults end one episode ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "error"),
    [
        (plugin.raises, "the agent raised RuntimeError: the agent broke"),
        (plugin.hangs, "the agent spent more than 0.5 s of its own time between two model calls"),
        (
            plugin.hangs_sync,
            "the agent spent more than 0.5 s of its own time between two model calls",
        ),
        (plugin.returns_text, "the agent returned 'great' as its reward"),
        (plugin.no_calls, "the agent made no call to the model"),
    ],
)
def test_a_failing_agent_fails_its_episode_only(server, tok, agent, error):
    backend = scripted(tok, ["x"], ["5"])
    good, bad = play(
        server,
        tok,
        _either(agent),
        [{"prompt": "good"}, {"prompt": "bad"}],
        backend,
        env_timeout_s=0.5,
    )
    assert good.error is None and good.reward == 1.0
    assert bad.error is not None and bad.error.startswith(error) and bad.reward == 0.0
    assert bad.error_kind == "env", "counted as an environment fault (max_failed_share)"


def _either(agent):
    """``agent`` on the row "bad", a well-behaved agent of the same kind on the row "good"."""
    import inspect

    if inspect.iscoroutinefunction(agent):

        async def both(client, row):
            if row["prompt"] == "bad":
                return await agent(client, row)
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            return 1.0

        return both

    def both_sync(client, row):
        if row["prompt"] == "bad":
            return agent(client, row)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return 1.0

    return both_sync


def test_an_agent_returning_nothing_needs_reward_functions(server, tok):
    async def silent(client, row):
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )

    backend = scripted(tok, ["x"])
    (ep,) = play(server, tok, silent, [{"prompt": "p"}], backend)
    assert ep.error.startswith("the agent returned no reward, and `--data.reward_funcs` is empty")
    (ep,) = play(
        server, tok, silent, [{"prompt": "p"}], scripted(tok, ["x"]), scored_elsewhere=True
    )
    assert ep.error is None and ep.agent_reward is None


# ---- bad requests get OpenAI's errors, and the rollout goes on -----------------------------------


BAD = [
    ({"messages": []}, 400, "'messages' must be a non-empty list"),
    (
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "'messages[0].role' \"robot\" is not one of",
    ),
    ({"n": 2}, 400, "'n' 2 is not supported by this endpoint"),
    ({"tool_choice": "required"}, 400, "'tool_choice' \"required\" is not supported"),
    ({"temperature": 9}, 400, "'temperature' must be a number in [0, 2], got 9"),
    ({"max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1, got 0"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        'is a "image_url" part; this endpoint takes text only',
    ),
]


def test_each_bad_request_gets_its_error_and_the_episode_goes_on(server, tok):
    seen = []

    async def probe(client, row):
        base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for change, _status, text in BAD:
            try:
                await client.chat.completions.create(**{**base, **change})
            except openai.APIStatusError as err:
                seen.append((err.status_code, err.body["message"], text))
        async with httpx.AsyncClient() as http:
            headers = {"Authorization": f"Bearer {client.api_key}"}
            r = await http.post(
                f"{client.base_url}chat/completions", content=b"{not json", headers=headers
            )
            seen.append(
                (r.status_code, r.json()["error"]["message"], "the request body is not valid JSON")
            )
            r = await http.post(
                f"{client.base_url}chat/completions",
                json=base,
                headers={"Authorization": "Bearer nobody"},
            )
            seen.append(
                (
                    r.status_code,
                    r.json()["error"]["message"],
                    "Incorrect API key provided: 'nobody'",
                )
            )
            r = await http.get(f"{client.base_url}models")
            assert r.json()["data"][0]["id"] == "earl-tiny"
            r = await http.get(f"{client.base_url}nowhere")
            seen.append((r.status_code, r.json()["error"]["message"], "no route '/v1/nowhere'"))
        r = await client.chat.completions.create(**base)
        return float(r.choices[0].message.content == "ok")

    (ep,) = play(server, tok, probe, [{"prompt": "p"}], scripted(tok, ["ok"]))
    assert ep.error is None and ep.reward == 1.0 and ep.num_turns == 1
    statuses = [s for s, _, _ in seen]
    assert statuses == [status for _, status, _ in BAD] + [400, 401, 404]
    for _, message, expected in seen:
        assert expected in message, (expected, message)


def test_a_call_past_the_limits_is_refused_and_the_episode_is_truncated(server, tok):
    async def long(client, row):
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 300}]
            )
        except openai.BadRequestError as err:
            assert err.code == "context_length_exceeded"
            assert "maximum context length is 200 tokens" in err.message
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        for _ in range(3):
            try:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
            except openai.BadRequestError as err:
                assert err.code == "max_turns_exceeded"
                return 1.0
        return 0.0

    (ep,) = play(
        server,
        tok,
        long,
        [{"prompt": "p"}],
        scripted(tok, ["ok"]),
        max_turns=2,
        max_context_tokens=200,
    )
    assert ep.error is None and ep.reward == 1.0 and ep.num_turns == 2
    assert not ep.truncated, "the agent handled the refusals and returned its reward"


def test_a_call_after_the_episode_ended_is_refused(server, tok):
    late = []

    async def leaves_a_call_behind(client, row):
        import asyncio

        async def later():
            await asyncio.sleep(0.3)
            try:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
            except openai.APIStatusError as err:
                late.append((err.status_code, err.code))

        if row["prompt"] == "quick":
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
            asyncio.ensure_future(later())
            return 1.0
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        await asyncio.sleep(1.0)
        return 1.0

    eps = play(
        server,
        tok,
        leaves_a_call_behind,
        [{"prompt": "quick"}, {"prompt": "slow"}],
        scripted(tok, ["a"], ["b"]),
    )
    assert [ep.error for ep in eps] == [None, None]
    assert late == [(409, "episode_ended")]


def test_the_calculator_agent_trains_on_the_tokens_the_environment_would(server, tok):
    """The calculator task as an OpenAI-SDK agent and as the built-in environment: the same model
    output gives the same token rows, masks and reward (so one warm start serves both)."""
    from earl_lightning.envs.calculator import make_question
    from earl_lightning.rollout import rollout
    from earl_lightning.rollout.demonstrations import PolicyBackend
    from earl_lightning.rollout.loop import ToolUse
    from earl_lightning.tasks.calculator_agent import calculator_agent
    from tests.plugins.scripted import Says

    bpe = load_tokenizer(str(make_tiny_model("earl-tiny-bpe-4l")))
    question, answer = make_question(5, "easy")
    script = [call("calculate", expression=question), str(answer)]
    kw = dict(max_turns=4, max_context_tokens=1536)
    spec = EpisodeSpec(
        "calculator", seed=5, group_id=0, episode_id=0, env_kwargs={"difficulty": "easy"}
    )
    backend = PolicyBackend({0: Says(*script)}, bpe)
    (native,) = rollout(
        [spec], backend, bpe, SamplingConfig(max_new_tokens=96), tools=ToolUse(hermes, ()), **kw
    )
    row = {"prompt": f"What is {question}? Answer with the number.", "answer": answer}
    (agent,) = play(server, bpe, calculator_agent, [row], ScriptedBackend({0: script}, bpe), **kw)
    assert native.reward == agent.reward == 1.0
    assert agent.token_ids == native.token_ids and agent.action_mask == native.action_mask


def test_the_same_model_samples_the_same_episodes_through_the_endpoint(server):
    """Real sampling (the tiny model, seeded): the calculator environment's episodes and the
    agent's are the same tokens, log-probs and rewards, whatever batches the endpoint formed."""
    from earl_lightning.envs.calculator import make_question
    from earl_lightning.rollout import rollout
    from earl_lightning.rollout.loop import ToolUse
    from earl_lightning.tasks.calculator_agent import calculator_agent

    path = make_tiny_model("earl-tiny-bpe-4l")
    bpe, model = load_tokenizer(str(path)), AutoModelForCausalLM.from_pretrained(str(path))
    sampling = SamplingConfig(max_new_tokens=24, seed=11)
    kw = dict(max_turns=4, max_context_tokens=1536)
    seeds = range(6)
    env_specs = [
        EpisodeSpec(
            "calculator", seed=s, group_id=s, episode_id=s, env_kwargs={"difficulty": "easy"}
        )
        for s in seeds
    ]
    native = rollout(
        env_specs, HFBackend(model, bpe), bpe, sampling, tools=ToolUse(hermes, ()), **kw
    )
    rows = []
    for s in seeds:
        question, answer = make_question(s, "easy")
        rows.append({"prompt": f"What is {question}? Answer with the number.", "answer": answer})
    agent = play(
        server, bpe, calculator_agent, rows, HFBackend(model, bpe), sampling=sampling, **kw
    )
    for a, n in zip(agent, native):
        assert a.token_ids == n.token_ids and a.action_mask == n.action_mask
        assert a.logprobs == pytest.approx(n.logprobs, abs=1e-5)
        assert a.reward == n.reward


def test_what_the_model_or_the_agent_sends_cannot_end_the_rollout(server, tok):
    """A call nested a thousand levels deep in the model's output comes back as text; a 10 MB
    message is refused before it is tokenized; the episode goes on."""
    deep = (
        "<tool_call>" + '{"name": "add", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    )
    answers = []

    async def agent(client, row):
        huge = [{"role": "user", "content": "x" * 10_000_000}]
        try:
            await client.chat.completions.create(model="m", messages=huge)
        except openai.BadRequestError as err:
            answers.append(err.code)
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=[ADD]
        )
        answers.append((r.choices[0].message.content, r.choices[0].message.tool_calls))
        return 1.0

    (ep,) = play(
        server,
        tok,
        agent,
        [{"prompt": "p"}],
        scripted(tok, [deep]),
        max_context_tokens=8192,
        sampling=SamplingConfig(max_new_tokens=4096, seed=0),
    )
    assert ep.error is None and ep.reward == 1.0 and not ep.truncated, "the agent went on"
    assert answers[0] == "context_length_exceeded"
    assert answers[1] == (deep, None), "an unreadable call is the response's text"


def test_an_agent_that_gives_up_on_a_refused_call_ends_truncated_not_failed(server, tok):
    async def gives_up(client, row):
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "again"}]
        )

    (ep,) = play(server, tok, gives_up, [{"prompt": "p"}], scripted(tok, ["ok"]), max_turns=1)
    assert ep.error is None and ep.truncated and not ep.done and ep.num_turns == 1
