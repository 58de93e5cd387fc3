"""A written conversation as the token sequence the rollout would have made of it.

For supervised training on a dataset (``earl sft`` on TRL's ``prompt``/``completion`` or
``messages`` rows): the ids and the assistant-token mask are built piece by piece from the chat
template exactly as :func:`~earl_lightning.rollout.loop.rollout` builds an episode (the first
prompt with its generation prompt; each assistant message's content as the model would generate
it, then its end-of-turn text; the messages between assistant turns as one delta), so a model
warm-started on these rows sees at RL time the very sequences it was trained on.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from earl_lightning.rollout.chat import ChatDeltas, Messages
from earl_lightning.rollout.loop import raw_prompt_ids
from earl_lightning.tasks.rows import check_messages, first_messages


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
    row: dict[str, Any], chat: ChatDeltas, system_prompt: str | None, where: str
) -> LabelledRow:
    """A supervised row in TRL's SFT forms: ``prompt`` + ``completion`` (the completion is
    labelled) or ``messages`` (every assistant message is labelled). A standard-form (string)
    prompt and completion are plain text, no chat template, the completion followed by eos (what
    the RL rollout of a string prompt generates)."""
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
        head = first_messages(check_messages(prompt, f"{where}: `prompt`"), system_prompt)
        tail = check_messages(completion, f"{where}: `completion`")
        return conversation_row(chat, head + tail, train_from=len(head))
    messages = check_messages(row.get("messages"), f"{where}: `messages`")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: `messages` has no assistant message: nothing to train on")
    return conversation_row(chat, first_messages(messages, system_prompt))
