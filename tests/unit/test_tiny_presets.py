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
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(deep, key) == getattr(base, key)
    # the preset and earl-tiny with the override are one spec: one directory, the same weights
    assert str(make_tiny_model("earl-tiny", num_hidden_layers=4)).split("-")[-1] == path.split("-")[-1]
    again = make_tiny_model("earl-tiny-4l", cache_dir=tmp_path / "again")
    a = AutoModelForCausalLM.from_pretrained(path).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown tiny model preset 'earl-tiny-8l'; valid: \['earl-tiny', "):
        make_tiny_model("earl-tiny-8l")
    assert "earl-tiny-4l" in PRESETS
