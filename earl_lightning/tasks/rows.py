"""Rows as TRL writes them: a ``prompt`` in the standard form (a string) or the conversational
form (a list of ``{"role", "content"}`` messages), plus any other columns, which travel with the
row to the environment's ``reset`` and to the reward functions.

Pure Python: no tokenizer, no torch. Every error names the setting and the row it came from.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from earl_lightning.core.errors import EarlError

Messages = list[dict[str, Any]]
PromptForm = Literal["standard", "conversational"]
ROLES = ("system", "user", "assistant", "tool")


def prompt_form(value: Any) -> PromptForm | None:
    """``standard`` for a string, ``conversational`` for a list of messages, None for anything else."""
    if isinstance(value, str):
        return "standard"
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        return "conversational"
    return None


def check_messages(value: Any, where: str) -> Messages:
    """``value`` as a list of chat messages, each with a known ``role`` and a string ``content``
    (an assistant message may carry ``tool_calls`` instead of content; the null ``tool_calls`` a
    dataset gives the other messages of a column is no call)."""
    if prompt_form(value) != "conversational":
        raise ValueError(
            f"{where} must be a non-empty list of messages such as [{{'role': 'user', 'content': "
            f"'...'}}], got {value!r:.120}"
        )
    out = []
    for i, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}, message {i}: role {role!r} is not one of {list(ROLES)}")
        calls = m.get("tool_calls")
        if calls and role != "assistant":
            raise ValueError(
                f"{where}, message {i}: a {role} message carries `tool_calls`; only an assistant "
                f"message calls tools"
            )
        if calls:
            check_tool_calls(calls, f"{where}, message {i}")
        if not isinstance(content, str) and not (role == "assistant" and calls):
            raise ValueError(f"{where}, message {i}: content must be a string, got {content!r:.80}")
        out.append(dict(m))
    return out


def call_parts(call: Any) -> tuple[Any, Any]:
    """The name and arguments of one entry of ``tool_calls``: TRL's / OpenAI's ``{"type":
    "function", "function": {"name", "arguments"}}``, or the flat ``{"name", "arguments"}`` that
    chat templates also read."""
    f = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(f, Mapping):
        return None, None
    return f.get("name"), f.get("arguments")


def check_tool_calls(value: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's ``tool_calls`` as ``(name, arguments)`` pairs; the arguments may be
    written as a JSON object or as a string holding one (OpenAI's form)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{where}: `tool_calls` must be a list of {{'type': 'function', 'function': {{'name': "
            f"..., 'arguments': {{...}}}}}}, got {value!r:.80}"
        )
    out = []
    for k, call in enumerate(value):
        name, arguments = call_parts(call)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not name or not isinstance(arguments, Mapping):
            raise ValueError(
                f"{where}: tool call {k} must be {{'type': 'function', 'function': {{'name': "
                f"<string>, 'arguments': <JSON object>}}}}, got {call!r:.100}"
            )
        out.append((name, dict(arguments)))
    return out


def check_prompt(value: Any, where: str) -> PromptForm:
    """The form of one ``prompt`` value, or an error naming ``where`` (e.g. "row 12 of split 'train'")."""
    form = prompt_form(value)
    if form is None:
        raise ValueError(
            f"{where}: `prompt` must be a string (standard form) or a list of messages "
            f"(conversational form), got {type(value).__name__} {value!r:.80}"
        )
    if form == "conversational":
        check_messages(value, f"{where}: `prompt`")
    return form


def check_rl_row(row: Mapping[str, Any], where: str) -> None:
    """An RL row: a ``prompt`` in either form (every other column is the task's own)."""
    check_prompt(row.get("prompt"), where)


def check_sft_row(row: Mapping[str, Any], where: str) -> None:
    """An SFT row in one of TRL's forms: ``prompt`` + ``completion``, both strings or both lists
    of messages; or ``messages`` with at least one assistant message (what is trained on)."""
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return
        if isinstance(prompt, str) or isinstance(completion, str):
            raise ValueError(
                f"{where}: `prompt` and `completion` must both be strings (standard form) or both "
                f"lists of messages (conversational form), got {type(prompt).__name__} and "
                f"{type(completion).__name__}"
            )
        check_messages(prompt, f"{where}: `prompt`")
        check_messages(completion, f"{where}: `completion`")
        return
    messages = check_messages(row.get("messages"), f"{where}: `messages`")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: `messages` has no assistant message: nothing to train on")


class BadRowError(EarlError, ValueError):
    """A dataset row the task cannot use (a null prompt, an unknown role), found when the row is
    first read. Also a ValueError: found while the `earl` command builds its classes it is bad
    input (exit 2); found later in the run an EarlError (exit 1); one line either way."""


def first_messages(prompt: Any, system_prompt: str | None, appended: str | None = None) -> Messages:
    """The chat a row starts from: its conversational prompt (a standard-form prompt becomes one
    user message), ``system_prompt`` first when the prompt has no system message, and
    ``appended`` (what an environment's ``reset`` returned) added to the last message's content,
    as TRL's ``environment_factory`` does."""
    messages = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else [dict(m) for m in prompt]
    )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if appended:
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + appended}
    return messages


@functools.lru_cache(maxsize=256)
def _accepted(fn: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    params = inspect.signature(fn).parameters.values()
    names = frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def accepted_kwargs(
    fn: Callable[..., Any], available: Mapping[str, Any], skip: Sequence[str] = ()
) -> dict[str, Any]:
    """The entries of ``available`` that ``fn`` takes by keyword (all of them when it has
    ``**kwargs``), less ``skip``."""
    try:
        names, var_kw = _accepted(getattr(fn, "__func__", fn))
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        names, var_kw = frozenset(), True
    return {k: v for k, v in available.items() if k not in skip and (var_kw or k in names)}


def reset_kwargs(reset: Callable[..., Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's columns that an environment's ``reset(seed, ...)`` takes by name (all of them
    when it has ``**kwargs``); ``seed`` itself is always passed by the caller."""
    return accepted_kwargs(reset, row, skip=("seed",))
