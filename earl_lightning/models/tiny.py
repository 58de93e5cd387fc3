"""The offline default model: a Qwen2-architecture causal LM with random weights and a
character-level tokenizer, saved with ``save_pretrained`` and loaded back through the normal
``from_pretrained`` path, so the code path is the one a hub id or a local checkpoint takes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
from pathlib import Path
from typing import Any

import torch

from earl_lightning.models.bpe import BPE_CHAT_TEMPLATE, build_bpe_tokenizer
from earl_lightning.models.chatml import (
    IM_END,
    MESSAGES,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOLS_SYSTEM_OPEN,
)

TINY_PREFIX = "earl-tiny"


# ChatML, the format of Qwen2.5 and Hermes, written for these models (models/chatml.py: the
# messages). With `tools`, the system message lists their schemas (name, description, parameters:
# short, for character-level models) and says how to call them.
CHAT_TEMPLATE = (
    TOOLS_SYSTEM_OPEN + "{{ 'Tools:' }}"
    "{%- for tool in tools -%}{%- set f = tool['function'] if 'function' in tool else tool -%}"
    "{{ '\n' + ({'name': f['name'], 'description': f['description'] if 'description' in f else '', 'parameters': f['parameters'] if 'parameters' in f else {}}"
    " | tojson) }}"
    "{%- endfor -%}"
    '{{ \'\nCall one with <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call>.<|im_end|>\n\' }}'
    "{%- endif -%}" + MESSAGES
)

# The same, except that, as Qwen3's template does, an assistant message before the last user
# message loses its <think>...</think> reasoning: rendering one more turn rewrites earlier text, so
# the rollout trains each turn as its own row.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- set ns = namespace(rest=messages) -%}",
    "{%- set ns = namespace(rest=messages, last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}",
).replace(
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}",
    "{%- set content = message['content'] or '' -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content and "
    "loop.index0 + (messages | length) - (ns.rest | length) < ns.last_user -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content }}",
)

# Sizes of the named presets. "earl-tiny" is the default of every recipe: small enough to learn
# Connect Four on two CPU cores in minutes. "earl-tiny-4l" is the same with 4 layers (0.8M
# parameters), the Connect Four warm start's model (docs/experiments/warm_start.md).
# "earl-tiny-100m" is the ~100M-parameter config the reshard and memory-model benchmarks use.
_TINY = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PRESETS: dict[str, dict[str, Any]] = {
    "earl-tiny": _TINY,
    "earl-tiny-local": {
        **_TINY,
        "sliding_window": 128,
    },  # the same, every layer Mistral-style windowed
    "earl-tiny-4l": {**_TINY, "num_hidden_layers": 4},
    "earl-tiny-think": {
        **_TINY,
        "chat_template": "thinking",
    },  # a template that rewrites earlier turns
    # a byte-level BPE tokenizer trained offline (models/bpe.py): merges across the rollout's joins
    "earl-tiny-bpe": {**_TINY, "tokenizer": "bpe"},
    # the same with 4 layers: the tool tasks' model (a tool call's JSON and the tools' schemas are
    # a few BPE tokens where the character tokenizer needs hundreds; docs/experiments/tools.md)
    "earl-tiny-bpe-4l": {**_TINY, "num_hidden_layers": 4, "tokenizer": "bpe"},
    "earl-tiny-100m": dict(
        hidden_size=768,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}


# what each preset is for (`earl presets`, docs/configuration.md)
PRESET_USES = {
    "earl-tiny": "every recipe's default; the tests",
    "earl-tiny-local": "the same, every layer windowed (Mistral-style sliding window of 128)",
    "earl-tiny-4l": "the Connect Four, tic-tac-toe, Hex and addition warm starts",
    "earl-tiny-think": "a chat template that drops earlier turns' reasoning (`<think>`), as Qwen3's",
    "earl-tiny-bpe": "earl-tiny with a byte-level BPE tokenizer",
    "earl-tiny-bpe-4l": "the tool tasks (calculator, inventory): a call is ~22 tokens, not ~84",
    "earl-tiny-100m": "the reshard and memory-model benchmarks",
}


def preset_table() -> list[dict[str, Any]]:
    """Every preset's shape, parameter count (Qwen2's, embeddings tied), tokenizer and chat
    template, computed without building anything."""
    from earl_lightning.models.bpe import TOOL_TOKENS, VOCAB_SIZE

    rows = []
    for name, spec in PRESETS.items():
        kw = {**_TINY, **spec}
        h, inter, layers = kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"]
        heads, kv = kw["num_attention_heads"], kw["num_key_value_heads"]
        bpe = kw.get("tokenizer") == "bpe"
        vocab = VOCAB_SIZE + len(TOOL_TOKENS) if bpe else len(char_vocab())
        vocab = (vocab + 7) // 8 * 8
        kv_dim = kv * h // heads
        # q, k, v with biases; o; the gated MLP; two norms
        layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * inter + 2 * h
        rows.append(
            {
                "name": name,
                "layers": layers,
                "hidden": h,
                "heads": f"{heads} ({kv} kv)",
                "parameters": vocab * h + layers * layer + h,
                "tokenizer": f"byte-level BPE, {vocab} ids" if bpe else f"characters, {vocab} ids",
                "chat_template": kw.get("chat_template", "chatml"),
                "use": PRESET_USES.get(name, ""),
            }
        )
    return rows


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the one byte-level BPE tokenizers use)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def char_vocab() -> dict[str, int]:
    """Special tokens first (ids 0..2), then newline, tab and printable ASCII, one token each.

    Characters are stored in byte-level form (space is ``\u0120``), so the same ``tokenizer.json``
    loads identically as a plain fast tokenizer and as transformers' ``Qwen2Tokenizer``, which
    ``AutoTokenizer`` picks for every Qwen2 checkpoint.
    """
    b2u = _byte_to_unicode()
    chars = ["\n", "\t"] + [c for c in string.printable if c not in "\n\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[b2u[ord(c)]] = len(vocab)
    return vocab


TEMPLATES = {"chatml": CHAT_TEMPLATE, "thinking": THINKING_CHAT_TEMPLATE}


def build_char_tokenizer(chat_template: str = "chatml"):
    """A character-level ``PreTrainedTokenizerFast`` with a ChatML chat template that speaks tools
    (``thinking``: the variant that drops earlier turns' reasoning)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE with no merges: every character is one token, and decoding is lossless.
    backend = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token=None, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TEMPLATES[chat_template]
    return tok


def tiny_config(vocab_size: int, seed: int = 0, **overrides: Any):
    """The ``Qwen2Config`` of a tiny model: the ``earl-tiny`` sizes changed by ``overrides``, a
    ``sliding_window`` spelled as Qwen2's per-layer sliding attention, tied embeddings, pad id 0
    and eos id 2. ``seed`` is accepted and unused (the weights' seed is :func:`make_tiny_model`'s)."""
    from transformers import Qwen2Config

    kw: dict[str, Any] = dict(PRESETS["earl-tiny"])
    kw.update(overrides)
    window = kw.pop("sliding_window", None)
    if window is not None:  # every layer attends to the last `window` tokens only (Mistral-style)
        kw.update(
            use_sliding_window=True,
            sliding_window=int(window),
            max_window_layers=0,
            layer_types=["sliding_attention"] * kw["num_hidden_layers"],
        )
    else:
        kw.update(use_sliding_window=False)
    return Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
        **kw,
    )


def _cache_root() -> Path:
    root = os.environ.get("EARL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "earl_lightning"
    )
    return Path(root)


def _cache_name(name: str, spec: dict[str, Any], seed: int) -> str:
    """The cached directory's name for a preset's ``spec`` and ``seed``. The chat templates are in
    the key: a cached directory keeps the template it was saved with."""
    templates = [CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE, BPE_CHAT_TEMPLATE]
    what = {"spec": spec, "seed": seed, "v": 4, "templates": templates}
    return f"{name}-{hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]}"


def make_tiny_model(
    name: str = TINY_PREFIX,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    **overrides: Any,
) -> Path:
    """Create (once) and return the directory of an offline model.

    ``name`` picks a preset from :data:`PRESETS`; ``overrides`` change its sizes. The directory is
    keyed by a hash of the full config and the seed, so the same arguments always give the same
    weights, and a second call only returns the path (bump the key's ``v`` when what a preset
    writes changes, e.g. the BPE corpus of :mod:`earl_lightning.models.bpe`).

    Args:
        name: the preset (``earl-tiny``, ``earl-tiny-4l``, ...).
        seed: the seed of the random initial weights.
        cache_dir: the directory to write instead of the keyed one under ``$EARL_CACHE_DIR``
            (default ``~/.cache/earl_lightning``).
        **overrides: preset fields to change (``num_hidden_layers``, ``sliding_window``, ...).

    Returns:
        The model's directory: weights, config and tokenizer, loadable by ``from_pretrained`` and
        as ``--model.model``.

    Raises:
        ValueError: ``name`` is not a preset (the message lists them).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown tiny model preset {name!r}; valid: {sorted(PRESETS)}")
    spec = dict(PRESETS[name])
    spec.update(overrides)
    out = (
        Path(cache_dir) if cache_dir is not None else _cache_root() / _cache_name(name, spec, seed)
    )
    if _complete(out):
        return out
    from transformers import AutoModelForCausalLM

    sizes = dict(spec)
    template = sizes.pop("chat_template", "chatml")
    tok = (
        build_bpe_tokenizer()
        if sizes.pop("tokenizer", "char") == "bpe"
        else build_char_tokenizer(template)
    )
    vocab = len(tok)
    cfg = tiny_config(vocab_size=((vocab + 7) // 8) * 8, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _save_whole(model, tok, out, name)
    return out


def _save_whole(model: Any, tok: Any, out: Path, name: str) -> None:
    """Write ``model`` and ``tok`` to ``out`` whole or not at all: into a directory of this process's
    own, then renamed into place (atomic; ranks building the same model race here)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers >= 5.19 writes a model only from rank 0 once torch.distributed is initialized,
    # and silently writes nothing elsewhere; here each rank builds its own copy (whichever renames
    # first wins), so every rank must write a whole model.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(tmp)
    if not (tmp / "config.json").exists():
        raise RuntimeError(
            f"save_pretrained wrote no config.json into {tmp}: cannot build the tiny model {name!r}"
        )
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out)  # atomic: concurrent ranks racing here both end with a whole model
    except OSError:  # another rank was first, or `out` is what a killed build left: replace that
        if not _complete(out):
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        shutil.rmtree(tmp, ignore_errors=True)


def _complete(directory: Path) -> bool:
    return all(
        (directory / name).exists()
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    )
