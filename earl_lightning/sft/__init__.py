"""The warm start: supervised fine-tuning on demonstration transcripts (``earl sft``).

A scripted policy plays the environment through the RL rollout loop
(:mod:`earl_lightning.rollout.demonstrations`), so the transcripts carry exactly the chat
template, history window and assistant-token mask of the RL rollouts; the model learns the
assistant tokens only, and the result is a ``save_pretrained`` directory that
``earl fit --model.model <dir>`` starts RL from.
"""

from earl_lightning.sft.datamodule import DemonstrationDataModule
from earl_lightning.sft.module import WarmStartModule

__all__ = ["DemonstrationDataModule", "WarmStartModule"]
