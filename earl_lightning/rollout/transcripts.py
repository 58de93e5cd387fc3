"""A written conversation as the token sequence the rollout would have made of it.

For supervised training on a dataset (``earl sft`` on TRL's ``prompt``/``completion`` or
``messages`` rows): the ids and the assistant-token mask are built piece by piece from the chat
template exactly as :func:`~earl_lightning.rollout.loop.rollout` builds an episode (the first
prompt with its generation prompt; each assistant message's content as the model would generate
it, then its end-of-turn text; the messages between assistant turns as one delta), so a model
warm-started on these rows sees at RL time the very sequences it was trained on.

An assistant message with structured ``tool_calls`` (TRL's and Hugging Face's form: ``{"role":
"assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": ...,
"arguments": {...}}}]}``) is what the model writes for it: the text the template renders for the
message after the generation prompt, which must read back as the same calls with the rollout's
tool parser. That text is trained on, and from there on the message is kept as the rollout keeps a
turn it played (``{"role": "assistant", "content": <text>}``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from earl_lightning.rollout.chat import ChatDeltas, Messages, NotAppendOnly
from earl_lightning.rollout.loop import raw_prompt_ids
from earl_lightning.tasks.rows import check_messages, check_tool_calls, first_messages
from earl_lightning.tasks.tool_parsers import get_tool_parser

PARSER_ARG = "--model.rollout.tool_parser"


class LabelledRow(NamedTuple):
    """Token ids, and 1 where the tokens are trained on (the assistant's own), 0 elsewhere."""

    input_ids: list[int]
    mask: list[int]


def conversation_row(chat: ChatDeltas, messages: Messages, train_from: int = 0) -> LabelledRow:
    """``messages`` in chat form; the assistant messages at index >= ``train_from`` are labelled.

    Each labelled assistant message contributes its content's tokens and, when the template's
    end-of-turn text starts with the tokenizer's eos text (ChatML's ``<|im_end|>``), that eos
    token: what the model generates to end its turn. The rest of the end-of-turn text is not.
    """
    tok = chat.tokenizer
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = (
        chat.encode(chat.prompt(messages[:first]))
        if first < len(messages)
        else chat.encode(chat.render(messages, generation_prompt=False))
    )
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        content = messages[i]["content"]
        end = chat.end_of_turn(messages[:i], content)
        label = 1 if i >= train_from else 0
        gen = chat.encode(content) if content else []
        eos_text = (
            tok.decode([tok.eos_token_id], skip_special_tokens=False)
            if tok.eos_token_id is not None
            else None
        )
        if eos_text and end.startswith(eos_text):
            gen, end = gen + [tok.eos_token_id], end[len(eos_text) :]
        ids += gen + chat.encode(end)
        mask += [label] * len(gen) + [0] * (len(ids) - len(mask) - len(gen))
        nxt = next(
            (j for j in range(i + 1, len(messages)) if messages[j]["role"] == "assistant"),
            len(messages),
        )
        if i + 1 < len(messages):
            before = chat.render(messages[: i + 1], generation_prompt=False)
            after = chat.render(messages[:nxt], generation_prompt=nxt < len(messages))
            if not after.startswith(before):
                raise ValueError(
                    "the chat template is not append-only: adding the messages after an assistant "
                    "turn changed earlier text"
                )
            delta = chat.encode(after[len(before) :])
            ids += delta
            mask += [0] * len(delta)
        i = nxt
    return LabelledRow(ids, mask)


def sft_row(
    row: dict[str, Any],
    chat: ChatDeltas,
    system_prompt: str | None,
    where: str,
    tool_parser: str | None = None,
) -> LabelledRow:
    """A supervised row in TRL's SFT forms: ``prompt`` + ``completion`` (the completion is
    labelled) or ``messages`` (every assistant message is labelled). A standard-form (string)
    prompt and completion are plain text, no chat template, the completion followed by eos (what
    the RL rollout of a string prompt generates). ``tool_parser``: the rollout's parser (its
    registered name or import path), which must read each structured tool call back from the
    text the template writes for it."""
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            tok = chat.tokenizer
            ids = raw_prompt_ids(tok, prompt)
            gen = list(tok.encode(completion, add_special_tokens=False)) + [tok.eos_token_id]
            return LabelledRow(ids + gen, [0] * len(ids) + [1] * len(gen))
        if isinstance(prompt, str) or isinstance(completion, str):
            raise ValueError(
                f"{where}: `prompt` and `completion` must both be strings (standard form) or both lists "
                f"of messages (conversational form)"
            )
        given = check_messages(prompt, f"{where}: `prompt`")
        head = first_messages(given, system_prompt)
        tail = check_messages(completion, f"{where}: `completion`")
        shift = len(given) - len(head)  # a system prompt put first moves the messages by one
        played = rollout_form(
            chat, head + tail, tool_parser, f"{where}: `prompt` + `completion`", shift
        )
        return conversation_row(chat, played, train_from=len(head))
    given = check_messages(row.get("messages"), f"{where}: `messages`")
    if not any(m["role"] == "assistant" for m in given):
        raise ValueError(f"{where}: `messages` has no assistant message: nothing to train on")
    messages = first_messages(given, system_prompt)
    shift = len(given) - len(messages)
    return conversation_row(
        chat, rollout_form(chat, messages, tool_parser, f"{where}: `messages`", shift)
    )


def rollout_form(
    chat: ChatDeltas, messages: Messages, tool_parser: str | None, where: str, shift: int = 0
) -> Messages:
    """``messages`` as the rollout keeps a transcript it played: each assistant message with
    structured ``tool_calls`` becomes ``{"role": "assistant", "content": <the text the model
    writes for it>}`` (:func:`called_text`); ``shift`` turns an index here into the row's own."""
    out: Messages = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = called_text(chat, out, m, tool_parser, f"{where}, message {i + shift}")
            m = {"role": "assistant", "content": text}
        out.append(m)
    return out


def called_text(
    chat: ChatDeltas, before: Messages, message: dict[str, Any], tool_parser: str | None, where: str
) -> str:
    """The text a model writes for ``message`` (an assistant message with ``tool_calls``) after
    ``before``: the template's render of it after the generation prompt, less the end-of-turn
    text, checked to read back as the same calls with ``tool_parser``."""
    calls = check_tool_calls(message["tool_calls"], where)
    if tool_parser is None:
        raise ValueError(
            f"{where} calls {[name for name, _ in calls]}, and `{PARSER_ARG}` is null: set the "
            f"parser of the model's tool-call format (hermes, llama3_json, mistral), the one the "
            f"RL run reads the calls with"
        )
    offered = [t["function"]["name"] for t in chat.tools or ()]
    unknown = sorted({name for name, _ in calls} - set(offered))
    if unknown:
        raise ValueError(
            f"{where} calls {unknown}, which the prompt does not offer (its tools: {offered}): "
            f"name the tools in `--data.tools` (or an environment that offers them), so that their "
            f"schemas are rendered as the RL run renders them"
        )
    written = {
        **message,
        "content": message.get("content") or "",
        "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
        ],
    }
    prompt = chat.render(before, generation_prompt=True)
    whole = chat.render([*before, written], generation_prompt=False)
    end = chat.end_of_turn(before, "")
    if not whole.startswith(prompt) or not whole.endswith(end):
        raise NotAppendOnly(
            f"{where}: the chat template does not render this message after the generation prompt "
            f"and before its end-of-turn text {end!r}; the rollout could not reproduce it"
        )
    text = whole[len(prompt) : len(whole) - len(end)]
    parsed = get_tool_parser(tool_parser, PARSER_ARG)(text)
    read = [(c.name, c.arguments) for c in parsed.calls]
    if parsed.errors or read != calls:
        raise ValueError(
            f"{where}: the chat template writes its tool_calls as {text!r:.160}, which the "
            f"`{PARSER_ARG}` {tool_parser!r} parser reads as {read or parsed.errors}, not "
            f"{calls}; set the parser of this template's tool-call format"
        )
    return text
