"""Tool calling through the rollout: the tools are in every prompt (the chat template's own
rendering), the model's calls are read in its format and answered with ``tool`` messages (mask
0), the token sequence is the template's render of the whole transcript, what goes wrong is a
message the model reads and a count; the calls of all episodes run at the same time, continuous
turns give the same episodes as lock-step ones, and a template that rewrites earlier turns trains
each turn as its own row."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoModelForCausalLM

from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.env_calls import forget_call_kinds
from earl_lightning.rollout.loop import ToolUse
from earl_lightning.rollout.scoring import transcript
from earl_lightning.tasks.tool_parsers import hermes
from earl_lightning.tasks.tools import resolve_tools
from tests.plugins import tools as plugin
from tests.plugins.scripted import Says

ASK = {"prompt": [{"role": "user", "content": "What is 2+3?"}]}


def call(name: str, **arguments) -> str:
    """A call exactly as the tiny models' template renders one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(make_tiny_model("earl-tiny")))


def play(tok, rows, scripts, env=None, tools=(plugin.add, plugin.nap), **kw):
    specs = [
        EpisodeSpec(env, seed=i, group_id=i, episode_id=i, row=row, row_index=i)
        for i, row in enumerate(rows)
    ]
    backend = PolicyBackend({i: Says(*s) for i, s in enumerate(scripts)}, tok)
    kw = dict(max_turns=6, max_context_tokens=4096) | kw
    return rollout(
        specs,
        backend,
        tok,
        SamplingConfig(max_new_tokens=256),
        tools=ToolUse(hermes, tuple(resolve_tools(list(tools)))),
        **kw,
    )


def test_a_tool_turn_is_rendered_as_the_template_renders_the_transcript(tok):
    (ep,) = play(tok, [ASK], [[call("add", a=2, b=3), "5"]])
    assert ep.done and ep.num_turns == 2 and ep.tool_calls == 1 and ep.tool_errors == 0
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[2] == {"role": "tool", "name": "add", "content": "5"}
    prompt, completion, ids = transcript(ep, tok)
    assert completion[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    ]
    whole = tok.apply_chat_template(
        [*prompt, {**completion[0], "content": ""}, *completion[1:]],
        tools=[t.schema for t in resolve_tools([plugin.add, plugin.nap])],
        tokenize=False,
    )
    assert tok.decode(ep.token_ids) == whole, (
        "the tokens are the template's own render of the tool transcript"
    )
    assert '"name": "nap"' in tok.decode(ep.token_ids[: ep.prompt_tokens]), (
        "the tools are in the prompt"
    )
    generated = tok.decode([t for t, m in zip(ep.token_ids, ep.action_mask) if m])
    assert generated == call("add", a=2, b=3) + "<|im_end|>5<|im_end|>", (
        "the tool's result is not trained on"
    )


def test_what_goes_wrong_is_a_message_the_model_reads_and_is_counted(tok):
    script = [call("mul", a=1) + call("add", a="x", b=1) + "<tool_call>{broken</tool_call>", "done"]
    (ep,) = play(tok, [ASK], [script])
    assert ep.error is None and ep.tool_calls == 3 and ep.tool_errors == 3
    contents = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert contents[0] == "Error: unknown tool 'mul'; the tools are ['add', 'nap']"
    assert (
        contents[1]
        == "Error: bad arguments for 'add': argument 'a' must be of type integer, got str 'x'"
    )
    assert contents[2].startswith("Error: a tool call is not valid JSON")


def test_an_environment_offers_its_own_tools_and_grades_the_answer(tok):
    row = {"prompt": [{"role": "user", "content": "Go."}], "target": 2}
    (ep,) = play(
        tok,
        [row],
        [[call("increment"), call("increment", by=1), "2"]],
        env="tests.plugins.tools.Counter",
        tools=(),
    )
    assert (
        ep.messages[0]["content"] == "Go. Count to 2." and ep.reward == 1.0 and ep.info["correct"]
    )
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["1", "2"]
    assert ep.turn_rewards == [0.0, 0.0, 1.0]


def test_the_calls_of_all_episodes_run_at_once(tok):
    """Six episodes each call a 0.4 s tool on each of two turns: the calls of a turn overlap once
    the tool is known to wait. Its first three calls run on the rollout's own thread, one after
    another (a tool that only computes stays there: a thread gains it nothing under the GIL);
    from then on its calls run on the worker threads, together."""
    forget_call_kinds()
    plugin.CALLS.clear()
    rows, scripts = (
        [ASK] * 6,
        [
            [call("nap", seconds=0.4, tag=str(i)), call("nap", seconds=0.4, tag=str(i)), "ok"]
            for i in range(6)
        ],
    )
    t0 = time.perf_counter()
    episodes = play(tok, rows, scripts)
    elapsed = time.perf_counter() - t0
    assert all(ep.tool_calls == 2 and ep.tool_errors == 0 for ep in episodes)
    starts = sorted(start for _, start, _ in plugin.CALLS)
    learning, first_turn, second_turn = starts[:3], starts[3:6], starts[6:]
    assert all(b - a >= 0.35 for a, b in zip(learning, learning[1:])), "one after another"
    assert max(first_turn) - min(first_turn) < 0.3, "the first turn's other calls started together"
    assert max(second_turn) - min(second_turn) < 0.3, "the second turn's six calls started together"
    assert elapsed < 12 * 0.4, "not one call after another"


def test_continuous_turns_give_the_episodes_lock_step_turns_give(tok):
    """Tools of different latency: with continuous turns the fast episodes go on generating while
    the slow ones wait, and the result is the same, episode by episode (HF backend, sampled)."""
    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_model("earl-tiny"))).eval()
    tools = ToolUse(hermes, tuple(resolve_tools([plugin.nap])))
    specs = [EpisodeSpec(None, seed=i, group_id=i, episode_id=i, row=ASK) for i in range(6)]
    kw = dict(max_turns=3, max_context_tokens=4096, tools=tools)

    def run(continuous):
        return rollout(
            specs,
            HFBackend(model, tok),
            tok,
            SamplingConfig(max_new_tokens=12, seed=5, temperature=1.3),
            continuous=continuous,
            **kw,
        )

    lock, cont = run(False), run(True)
    for a, b in zip(lock, cont):
        assert (a.token_ids, a.action_mask, a.logprobs, a.messages) == (
            b.token_ids,
            b.action_mask,
            b.logprobs,
            b.messages,
        )


def test_a_hung_tool_is_an_error_after_the_time_limit_and_the_episode_goes_on(tok):
    plugin.RELEASE.clear()
    try:
        t0 = time.perf_counter()
        (ep,) = play(
            tok,
            [ASK],
            [[call("hang", label="x"), "gave up"]],
            tools=(plugin.hang,),
            env_timeout_s=0.5,
        )
        elapsed = time.perf_counter() - t0
    finally:
        plugin.RELEASE.set()
    assert elapsed < 5.0 and ep.error is None and ep.done
    assert (
        ep.messages[2]["content"] == "Error: 'hang' did not return within 0.5 s"
        and ep.tool_errors == 1
    )


def test_async_tools_are_awaited_together(tok):
    t0 = time.perf_counter()
    episodes = play(
        tok,
        [ASK] * 8,
        [[call("anap", seconds=0.5), "ok"]] * 8,
        tools=(plugin.anap,),
        call_workers=8,
    )
    assert time.perf_counter() - t0 < 8 * 0.5 and all(ep.tool_errors == 0 for ep in episodes)


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_as_its_own_row(tok):
    """The earl-tiny-think template drops an assistant turn's <think> block once a user message
    follows it (as Qwen3's does): from then on each turn is generated from the template's whole
    render of it, and the episode trains as one row per turn."""
    think = load_tokenizer(str(make_tiny_model("earl-tiny-think")))
    row = {"prompt": [{"role": "user", "content": "Hi."}], "start": 3}
    (ep,) = play(
        think,
        [row],
        [["<think>one</think>\n2", "<think>two</think>\n1", "<think>three</think>\n0"]],
        env="tests.plugins.rewards.CountDown",
        tools=(),
    )
    assert ep.reward == 1.0 and ep.turn_prompts is not None and len(ep.turn_prompts) == 3
    assistants = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"]
    for k, prompt in enumerate(ep.turn_prompts):
        want = think.apply_chat_template(
            ep.messages[: assistants[k]], add_generation_prompt=True, tokenize=False
        )
        assert think.decode(prompt) == want, (
            f"turn {k} was not generated from the template's render"
        )
    assert "<think>one</think>" not in think.decode(ep.turn_prompts[1]), (
        "earlier reasoning left the prompt"
    )
    from earl_lightning.batches.episodes import episodes_to_experience

    exp = episodes_to_experience([ep])
    assert len(exp) == 3 and exp.seqs["turn_index"].tolist() == [0, 1, 2], "one row per turn"


def test_a_call_that_holds_the_gil_ends_only_its_episode_in_process_isolation(tok):
    """A step stuck in the C regex engine holds the GIL: in a process of its own it is killed at the
    time limit, its episode fails, and the other episodes of the rollout finish."""
    specs = [
        EpisodeSpec("tests.plugins.tools.HoldsTheGil", seed=s, group_id=s, episode_id=s)
        for s in range(3)
    ]
    backend = PolicyBackend({s: Says("hi") for s in range(3)}, tok)
    t0 = time.perf_counter()
    episodes = rollout(
        specs,
        backend,
        tok,
        SamplingConfig(max_new_tokens=8),
        max_turns=2,
        max_context_tokens=1024,
        env_timeout_s=2.0,
        call_isolation="process",
    )
    elapsed = time.perf_counter() - t0
    assert elapsed < 30.0
    assert episodes[0].error == (
        "env 'tests.plugins.tools.HoldsTheGil' (seed 0): step() did not return within "
        "env_timeout_s=2s; its worker process is killed"
    )
    assert [ep.reward for ep in episodes[1:]] == [1.0, 1.0] and all(
        ep.error is None for ep in episodes[1:]
    )


def test_process_isolation_plays_as_threads_do_and_offers_the_envs_tools(tok):
    row = {"prompt": [{"role": "user", "content": "Go."}], "target": 2}
    script = [call("increment"), call("increment", by=1), "2"]
    here, there = (
        play(tok, [row], [script], env="tests.plugins.tools.Counter", tools=(), call_isolation=iso)[
            0
        ]
        for iso in ("thread", "process")
    )
    assert there.reward == 1.0 and (here.token_ids, here.messages) == (
        there.token_ids,
        there.messages,
    )


def test_a_task_tool_that_holds_the_gil_ends_only_its_call_in_process_isolation(tok):
    """The task's own tools (no environment here) run in each episode's worker process: a call
    stuck in the C regex engine is killed at the time limit and read as an error by its episode;
    the other episode's calls and the rest of the rollout go on."""
    rows = [ASK, ASK]
    scripts = [
        [call("match", text="a" * 64), "no idea"],
        [call("match", text="aab"), call("add", a=2, b=3), "5"],
    ]
    t0 = time.perf_counter()
    stuck, fine = play(
        tok,
        rows,
        scripts,
        tools=(plugin.add, plugin.match),
        env_timeout_s=2.0,
        call_isolation="process",
    )
    assert time.perf_counter() - t0 < 30.0
    assert stuck.messages[2] == {
        "role": "tool",
        "name": "match",
        "content": "Error: 'match' did not return within 2 s",
    }
    assert stuck.tool_errors == 1 and stuck.done and stuck.error is None
    assert [m["content"] for m in fine.messages if m["role"] == "tool"] == [
        "yes",
        "5",
    ] and fine.tool_errors == 0


def test_task_tools_in_worker_processes_play_as_threads_do(tok):
    scripts = [
        [call("add", a=2, b=3), call("nap", seconds=0.01), "5"],
        [call("add", a=1, b=1), "2"],
    ]
    here, there = (
        play(tok, [ASK, ASK], scripts, call_isolation=iso) for iso in ("thread", "process")
    )
    assert [(e.token_ids, e.messages, e.tool_calls) for e in here] == [
        (e.token_ids, e.messages, e.tool_calls) for e in there
    ]


def test_a_task_tool_that_cannot_reach_a_worker_process_is_one_line(tok):
    lam = {
        "schema": {
            "type": "function",
            "function": {
                "name": "twice",
                "description": "Twice a number.",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        },
        "fn": lambda x: 2 * x,
    }
    with pytest.raises(
        ValueError,
        match=r"^`--data.tools` tool 'twice' cannot run in a worker process "
        r"\(`call_isolation: process`\): its function does not pickle",
    ):
        play(tok, [ASK], [["hi"]], tools=(lam,), call_isolation="process")
