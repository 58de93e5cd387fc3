"""A small byte-level BPE tokenizer, trained offline on a corpus generated here, for the
``earl-tiny-bpe`` preset: the character-level tokenizer never merges characters, so it cannot show
what merges do where the rollout joins pieces of a chat that were encoded one at a time.

The pre-tokenization (NFC, then Qwen2's split pattern, then byte-level) is the one transformers'
``Qwen2Tokenizer`` applies, which ``AutoTokenizer`` picks for every Qwen2 checkpoint: the
tokenizer this module saves encodes exactly as the one ``from_pretrained`` loads back.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from earl_lightning.models.chatml import (
    IM_END,
    MESSAGES,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOLS_SYSTEM_OPEN,
)

# Whole tokens, as in Qwen2.5's vocabulary, but not special: decoding never skips them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 2048

# ChatML, written for this tokenizer. Every message renders as <|im_start|>role\ncontent<|im_end|>\n.
# With `tools`, the system message (its own content first) lists the tools' JSON schemas, one a
# line, between <tools> tags; an assistant message's `tool_calls` follow its content as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, one per line; a run of `tool` messages
# renders as one user message of <tool_response> blocks (the Hermes / Qwen format `hermes` parses).
BPE_CHAT_TEMPLATE = (
    TOOLS_SYSTEM_OPEN + "{{ 'You may call these tools:\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}"
    '{{ \'\n</tools>\nTo call one, write <tool_call>\n{"name": <name>, "arguments": <json object>}\n'
    "</tool_call><|im_end|>\n' }}"
    "{%- endif -%}" + MESSAGES
)

_WORDS = (
    "You are x. You are o. Opponent played What is Answer with the number digit shown turn(s) ago "
    "Turn Digit Legal Play a column Player Tic Tac Toe win three in a row board square cost does one "
    "many figs apples pears stock weigh price weight item error unknown tool bad arguments must be "
    "of type integer got the and to your mark center cell goal select Invalid move game over draw"
).split()


_SYLLABLES = (
    "ka to ri pe mun sol ar en il ost ve dra qui lo ne ta bor cle sta ing er ion tri fa".split()
)


def _prose(rng: random.Random, words: int) -> str:
    """Built-in words and made-up ones: enough distinct words for a few thousand merges."""
    out = [
        rng.choice(_WORDS)
        if rng.random() < 0.6
        else "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        for _ in range(words)
    ]
    return " ".join(out).capitalize() + rng.choice([".", "?", "!", ":", ".\n\n", ",\n"])


def _board(rng: random.Random, rows: int, cols: int) -> str:
    cells = [[rng.choice(".....xo") for _ in range(cols)] for _ in range(rows)]
    return "\n".join("".join(r) for r in cells)


def _call(rng: random.Random) -> str:
    name = rng.choice(["calculate", "price", "stock", "weight", "add", "lookup"])
    args = (
        {"expression": f"{rng.randint(0, 99)}{rng.choice('+-*')}{rng.randint(0, 99)}"}
        if name == "calculate"
        else {"item": rng.choice(["figs", "apples", "pears", "nuts"])}
        if name in ("price", "stock", "weight")
        else {"a": rng.randint(0, 999), "b": rng.randint(0, 999)}
    )
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def corpus(n: int = 6000, seed: int = 0) -> Iterator[str]:
    """Text like the built-in tasks' (boards, legal moves, questions, numbers, tool calls and
    schemas) in ChatML scaffolding; the same lines for the same ``n`` and ``seed``."""
    rng = random.Random(seed)
    for i in range(n):
        kind = i % 5
        if kind == 0:
            rows, cols = rng.choice([(6, 7), (3, 3), (5, 5)])
            legal = " ".join(str(c) for c in range(cols * (1 if rows == 6 else rows)))
            body = (
                f"You are {rng.choice('xo')}. Opponent played {rng.randint(0, 8)}.\n"
                f"{_board(rng, rows, cols)}\nLegal: {legal}"
            )
        elif kind == 1:
            body = f"What is {rng.randint(0, 99)}{rng.choice('+-*')}{rng.randint(0, 99)}? Answer with the number."
        elif kind == 2:
            body = (
                f"Turn {rng.randint(1, 9)}/{rng.randint(1, 9)}. Digit: {rng.randint(0, 9)}.\n"
                + "\n\n".join(_prose(rng, rng.randint(3, 20)) for _ in range(rng.randint(1, 3)))
            )
        elif kind == 3:
            body = _call(rng)
        else:
            body = json.dumps(
                {
                    "type": "function",
                    "function": {
                        "name": rng.choice(_WORDS),
                        "description": " ".join(rng.choice(_WORDS) for _ in range(5)),
                        "parameters": {
                            "type": "object",
                            "properties": {"item": {"type": "string"}},
                        },
                    },
                }
            )
        role = rng.choice(["user", "assistant", "system"])
        # The special tokens are whole tokens already: the scaffolding between them is what is learnt.
        yield f"{role}\n{body}\n"
        yield f"assistant\n{rng.randint(0, 9999)}"


def build_bpe_tokenizer():
    """Train the byte-level BPE tokenizer (:data:`VOCAB_SIZE` tokens) on :func:`corpus`; a
    ``PreTrainedTokenizerFast`` with :data:`BPE_CHAT_TEMPLATE`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    backend.add_tokens(TOOL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = BPE_CHAT_TEMPLATE
    return tok
