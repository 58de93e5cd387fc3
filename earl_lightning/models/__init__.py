from earl_lightning.models.loading import (
    eval_mode,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from earl_lightning.models.tiny import PRESETS, build_char_tokenizer, make_tiny_model

__all__ = [
    "eval_mode",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model_path",
    "PRESETS",
    "build_char_tokenizer",
    "make_tiny_model",
]
