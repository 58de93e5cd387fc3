"""The calculator task written as users write agents: a plain OpenAI-SDK tool-calling loop.

The same task as the built-in ``calculator`` environment (``envs/calculator.py``), played from a
dataset row (``scripts/make_calculator.py``: the questions of the environment's seeds) by an
agent that owns its loop: it sends the question with the ``calculate`` tool's schema, runs each
call the model makes, sends the results back as ``tool`` messages, and scores the final answer.
Its transcript renders token for token as the environment's does, so the environment's warm
start serves it unchanged (``recipes/calculator_agent_grpo_warm.yaml``).

Nothing here knows the trainer: pointed at any OpenAI-compatible ``base_url`` it runs the same.
"""

from __future__ import annotations

import json
from typing import Any

from transformers.utils import get_json_schema

from earl_lightning.envs.calculator import CalcError, format_number, safe_eval
from earl_lightning.envs.parsing import read_int

MODEL = "policy"  # the endpoint serves one model, whatever the name


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers with + - * / // % ** and parentheses.
    """
    try:
        return format_number(safe_eval(str(expression)))
    except CalcError as err:
        return f"Error: {err}"


# the schema as transformers writes it from the function (what the environment's tool renders)
CALCULATE = get_json_schema(calculate)


def run_call(arguments: str, calls_left: int) -> str:
    """The tool's answer to one call (its arguments as the model wrote them), or the error the
    model reads."""
    if calls_left <= 0:
        return "Error: no calculator calls left"
    try:
        args = json.loads(arguments)
        return calculate(**args)
    except (ValueError, TypeError) as err:
        return f"Error: {err}"


async def calculator_agent(
    client: Any, row: dict[str, Any], answer: int, max_tool_calls: int = 3
) -> dict[str, Any]:
    """Answer ``row["prompt"]`` with the calculator; reward 1 for the right number, 0 for a wrong
    one, -1 for an answer that is not a number (the environment's rewards)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    calls = 0
    while True:
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=[CALCULATE]
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls += 1
            result = run_call(call.function.arguments, max_tool_calls - calls + 1)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    number = _integer(message.content or "")
    correct = number is not None and number == answer
    reward = 1.0 if correct else 0.0 if number is not None else -1.0
    info = {"correct": correct, "tool_calls": calls, "invalid_action": number is None}
    return {"reward": reward, "info": info}


def _integer(text: str) -> int | None:
    text = text.strip()
    return read_int(text) if text.lstrip("+-").isdigit() else None
