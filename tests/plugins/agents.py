"""Agents as users write them, against the endpoint's OpenAI client (tests and recipes name them
by import path), and a scripted backend that answers each episode's calls with given texts."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from earl_lightning.rollout.demonstrations import PolicyBackend
from earl_lightning.rollout.endpoint.record import episode_of

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class ScriptedBackend(PolicyBackend):
    """Each episode's calls answered in order by its script's texts (the last one repeated), on
    any of the episode's rows."""

    def __init__(self, scripts: dict[int, list[str]], tokenizer: Any) -> None:
        super().__init__({}, tokenizer, "script")
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.calls: list[list[int]] = []  # the keys of each generate call

    def generate(self, requests, sampling):
        self.calls.append([r.key for r in requests])
        for r in requests:
            script = self.scripts[episode_of(r.key)]
            said = script.pop(0) if len(script) > 1 else script[0]
            self.policies[r.key] = lambda _obs, said=said: said
        return super().generate(requests, sampling)

    def release(self, keys=None) -> None: ...


def call(name: str, **arguments) -> str:
    """A call as the tiny models' template renders one (Hermes)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def chat(client, row):
    """Two calls that continue one conversation, then a third that rewrites it; reward 1."""
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = []
    for _ in range(2):
        r = await client.chat.completions.create(model="m", messages=messages, logprobs=True)
        seen.append(r)
        messages += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "more"},
        ]
    summary = [{"role": "user", "content": "summary of: " + row["prompt"]}]
    seen.append(await client.chat.completions.create(model="m", messages=summary))
    chat.seen[row["prompt"]] = seen
    return 1.0


chat.seen = {}


async def tool_user(client, row):
    """A tool-calling loop as the openai SDK's docs show it: run each call, send the results."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        r = await client.chat.completions.create(model="m", messages=messages, tools=[ADD])
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"reward": float(message.content == "5"), "info": {"calls": len(messages)}}
        for c in message.tool_calls:
            args = json.loads(c.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])}
            )


def sync_agent(client, row, answer):
    """A plain def with the sync client; a column by name."""
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return float(r.choices[0].message.content == str(answer))


async def raises(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent broke")


async def hangs(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await asyncio.sleep(3600)


def hangs_sync(client, row):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    time.sleep(3600)


async def returns_text(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return "great"


async def no_calls(client, row):
    return 1.0


async def agents_sdk(client, row):
    """The OpenAI Agents SDK's own loop (Agent + Runner), its model the endpoint's client."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    agent = Agent(
        name="adder",
        instructions="Use the tool.",
        tools=[add],
        model=OpenAIChatCompletionsModel(model="m", openai_client=client),
    )
    result = await Runner.run(agent, row["prompt"], max_turns=4)
    return float(str(result.final_output).strip() == "5")


async def varied(client, row):
    """Two calls of one conversation; a reward that varies with what was sampled, so that GRPO
    groups have spread (the resume and layout tests then compare real updates)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "and?"},
    ]
    r2 = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    ids = r.choices[0].token_ids + r2.choices[0].token_ids
    return {"reward": (sum(ids) % 7) / 6.0, "info": {"outcome": "win" if sum(ids) % 2 else "loss"}}
