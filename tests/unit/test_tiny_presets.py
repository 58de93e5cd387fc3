"""The offline model presets: ``earl-tiny-4l`` (the Connect Four warm start's model) is earl-tiny
with 4 layers, built once, loaded through ``from_pretrained``, and the same weights every time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from earl_lightning.models import PRESETS, make_tiny_model, resolve_model_path


def test_four_layer_preset_is_earl_tiny_with_four_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("EARL_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("earl-tiny-4l")
    deep = AutoModelForCausalLM.from_pretrained(path).config
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("earl-tiny")).config
    assert deep.num_hidden_layers == 4 and base.num_hidden_layers == 2
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert getattr(deep, key) == getattr(base, key)
    # the preset and earl-tiny with the override are one spec: one directory, the same weights
    assert (
        str(make_tiny_model("earl-tiny", num_hidden_layers=4)).split("-")[-1] == path.split("-")[-1]
    )
    again = make_tiny_model("earl-tiny-4l", cache_dir=tmp_path / "again")
    a = AutoModelForCausalLM.from_pretrained(path).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown tiny model preset 'earl-tiny-8l'; valid: \['earl-tiny', "
    ):
        make_tiny_model("earl-tiny-8l")
    assert "earl-tiny-4l" in PRESETS


def test_bpe_preset_is_built_the_same_every_time_and_loads_as_saved(tmp_path):
    """earl-tiny-bpe: a byte-level BPE tokenizer trained offline; two builds write the same files,
    and the tokenizer from_pretrained loads (transformers' Qwen2Tokenizer) encodes as the saved
    tokenizer.json does."""
    from transformers import PreTrainedTokenizerFast

    from earl_lightning.models import load_tokenizer

    a, b = (make_tiny_model("earl-tiny-bpe", cache_dir=tmp_path / d) for d in "ab")
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
    ):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    tok, saved = (
        load_tokenizer(str(a)),
        PreTrainedTokenizerFast(tokenizer_file=str(a / "tokenizer.json")),
    )
    assert len(tok) > 2000 and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 0
    call = '<tool_call>\n{"name": "calculate"}\n</tool_call>'
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "What is 20+4?\n\nAnswer with the number."},
            {"role": "assistant", "content": call},
        ],
        tools=[{"type": "function", "function": {"name": "calculate"}}],
        tokenize=False,
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == saved.encode(text, add_special_tokens=False) and tok.decode(ids) == text
    assert len(ids) < len(text) / 2, "characters are merged"
    assert tok.convert_ids_to_tokens(tok.encode("<tool_call>", add_special_tokens=False)) == [
        "<tool_call>"
    ]
