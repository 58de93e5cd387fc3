"""Token deltas of a growing chat transcript, taken from the tokenizer's own chat template.

Nothing here knows ChatML: every piece of scaffolding (end of an assistant turn, the next user or
tool messages, the assistant generation prompt) is the difference between two renders of the
transcript, with and without the new messages, each render given the episode's tools (``tools=``).
Where the template is append-only (rendering more messages only appends text: ChatML, Llama-3,
Mistral) the deltas are exact; a template that rewrites earlier turns (Qwen3's drops earlier
``<think>`` blocks) raises :class:`NotAppendOnly`, and the rollout then generates each turn from
the template's whole render of it (:meth:`ChatDeltas.prompt`) and trains it as its own row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Messages = list[dict[str, str]]

# Content used to learn the end-of-turn text when a template rewrites the real content (e.g.
# strips whitespace), so the real content is not a prefix of the rendered delta.
_PLACEHOLDER = "x"
MEMO_ENTRIES = 4096


class NotAppendOnly(ValueError):
    """Adding a message changed earlier text of the render: the template rewrites earlier turns."""


class ChatDeltas:
    """Renders the pieces the rollout loop appends to an episode's token sequence.

    Renders and encodings are remembered for the object's life (one rollout; at most
    :data:`MEMO_ENTRIES` of each): a group's episodes start from the same prompt, and every turn
    closes with the same scaffolding. A render runs the tokenizer's compiled template directly
    (:func:`direct_renderer`: what ``apply_chat_template`` renders, without its per-call set-up),
    checked once against ``apply_chat_template``; where they differ, or the template cannot be
    had, every render goes through ``apply_chat_template``.

    Args:
        tokenizer: a tokenizer with a chat template (``apply_chat_template``, ``encode``, ``decode``).
        tools: the JSON schemas handed to the template (``apply_chat_template(..., tools=...)``) on
            every render; None: no tools.
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("`tokenizer` has no chat template; multi-turn rollout needs one")
        self.tokenizer, self.tools = tokenizer, tools or None
        self._renders: dict[tuple, str] = {}
        self._direct = direct_renderer(tokenizer, self.tools)
        self._checked = False
        self._encodings: dict[str, tuple[int, ...]] = {}

    def render(self, messages: Messages, generation_prompt: bool) -> str:
        # a message's items in its own order: the same message written in another key order only
        # misses the memo (half the cost of sorting them, which every render call paid)
        try:
            key = (generation_prompt, *(tuple(m.items()) for m in messages))
            text = self._renders.get(key)
        # a message with unhashable values (e.g. a list of tool calls), or not a mapping: no memo
        except (TypeError, AttributeError):
            key, text = None, None
        if text is None:
            text = self._render(messages, generation_prompt)
            if key is not None and len(self._renders) < MEMO_ENTRIES:
                self._renders[key] = text
        return text

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        if self._direct is not None and self._checked:
            return self._direct(messages, generation_prompt)
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        if self._direct is not None:  # the first render: does the direct one agree?
            try:
                same = self._direct(messages, generation_prompt) == text
            except Exception:  # noqa: BLE001 - any failure means: use apply_chat_template
                same = False
            self._direct, self._checked = (self._direct if same else None), True
        return text

    def encode(self, text: str) -> list[int]:
        ids = self._encodings.get(text)
        if ids is None:
            # The template already carries any BOS / special tokens as text.
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            if len(self._encodings) < MEMO_ENTRIES:
                self._encodings[text] = ids
        return list(ids)

    def prompt(self, messages: Messages) -> str:
        """The whole first context: the messages and the assistant generation prompt."""
        return self.render(messages, generation_prompt=True)

    def end_of_turn(self, messages: Messages, content: str) -> str:
        """Text the template puts after an assistant message's content (e.g. ``<|im_end|>\\n``).

        ``messages`` is the transcript before the assistant message.
        """
        before = self.render(messages, generation_prompt=True)
        for text in (content, _PLACEHOLDER):
            after = self.render(
                [*messages, {"role": "assistant", "content": text}], generation_prompt=False
            )
            delta = _delta(before, after, "an assistant message")
            if delta.startswith(text):
                return delta[len(text) :]
        raise ValueError(
            "the chat template does not render an assistant message's content verbatim after the generation "
            f"prompt (got {delta!r}); multi-turn rollout needs an append-only template"
        )

    def next_user(self, messages: Messages, observation: str) -> str:
        """Text for a new user message plus the assistant generation prompt.

        ``messages`` ends with the assistant message just played.
        """
        return self.next_messages(messages, [{"role": "user", "content": observation}])

    def next_messages(self, messages: Messages, new: Messages) -> str:
        """Text for ``new`` messages (a user message, or a turn's tool results) plus the assistant
        generation prompt; raises :class:`NotAppendOnly` when they change earlier text."""
        before = self.render(messages, generation_prompt=False)
        after = self.render([*messages, *new], generation_prompt=True)
        return _delta(before, after, f"{new[0]['role']} message(s)")

    def rewritten_tail(self, messages: Messages, new: Messages) -> str:
        """For a template that rewrote earlier text: the whole render after ``new`` from where it
        first differs from the render before them (what the episode's whole-chat sequence, kept
        for transcripts and metrics, appends; the turn itself is generated from :meth:`prompt`)."""
        before = self.render(messages, generation_prompt=False)
        after = self.render([*messages, *new], generation_prompt=True)
        same = next(
            (i for i, (a, b) in enumerate(zip(before, after)) if a != b),
            min(len(before), len(after)),
        )
        return after[same:]


def direct_renderer(
    tokenizer: Any, tools: list[dict[str, Any]] | None
) -> Callable[[Messages, bool], str] | None:
    """``render(messages, generation_prompt)``: the tokenizer's chat template (as
    ``get_chat_template`` picks it for ``tools``), compiled as transformers compiles it, rendered
    with the variables ``apply_chat_template`` passes (the special tokens, ``tools``,
    ``documents=None``, ``messages``, ``add_generation_prompt``) in a context that holds them and
    the template's globals as they are, where ``Template.render`` copies every global into a new
    dict first. None where the template or transformers' compiler cannot be had."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = _compile_jinja_template(tokenizer.get_chat_template(None, tools))
        fixed = {
            **dict(template.globals),
            **tokenizer.special_tokens_map,
            "tools": tools,
            "documents": None,
        }
    except Exception:  # noqa: BLE001 - no direct renderer; apply_chat_template renders
        return None

    def render(messages: Messages, generation_prompt: bool) -> str:
        variables = {**fixed, "messages": messages, "add_generation_prompt": generation_prompt}
        context = template.new_context(variables, shared=True)
        return template.environment.concat(template.root_render_func(context))

    return render


def _delta(before: str, after: str, what: str) -> str:
    if not after.startswith(before):
        raise NotAppendOnly(
            f"the chat template is not append-only: adding {what} changed earlier text "
            f"(render before ends {before[-40:]!r}, after has {after[len(before) - 40 : len(before)]!r} there)"
        )
    return after[len(before) :]
