"""``earl`` command line: LightningCLI over :class:`AgenticRLModule` and :class:`EpisodeDataModule`.

    earl fit --config recipes/connect4_grpo.yaml --trainer.max_steps 5
    earl validate --config recipes/connect4_grpo.yaml --ckpt_path last

The omegaconf parser mode lets recipes interpolate (``${model.max_new_tokens}``).
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from earl_lightning.data.datamodule import EpisodeDataModule
from earl_lightning.modules.rl import AgenticRLModule

# Imported for its side effect: registers "earl" in Lightning's StrategyRegistry, so a recipe's
# `trainer.strategy: earl` resolves. Optional while the strategy is being built.
try:  # pragma: no cover - exercised through the recipes
    import earl_lightning.strategies  # noqa: F401
except ImportError:
    pass


class EarlCLI(LightningCLI):
    def instantiate_classes(self) -> None:
        # Bad input is reported as one clear line naming the argument, not a traceback from deep inside.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, ImportError) as err:
            print(f"earl: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    EarlCLI(
        AgenticRLModule,
        EpisodeDataModule,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
