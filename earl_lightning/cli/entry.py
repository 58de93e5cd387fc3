"""``earl`` command line: LightningCLI over :class:`AgenticRLModule` and :class:`EpisodeDataModule`.

    earl fit --config recipes/connect4_ppo.yaml --trainer.max_steps 5
    earl validate --config recipes/connect4_ppo.yaml --ckpt_path last
    earl sft --config recipes/connect4_sft.yaml            # the warm start: a save_pretrained directory
    earl profile --config recipes/connect4_grpo.yaml --out profiles/connect4 --budget-s 300
    earl export --ckpt_path runs/connect4_grpo/.../last.ckpt --out my_model   # a save_pretrained directory
    earl plan --model config.json --cluster 16x8xH100-80G --recipe recipes/connect4_ppo.yaml

``profile`` is not a LightningCLI subcommand: it measures the recipe's model per stage and layout
(:mod:`earl_lightning.profiling.command`) for ``AdaptiveParallelism(profile=...)``. Nor is ``export``
(:mod:`earl_lightning.checkpoints.export`): it rebuilds a checkpoint's model from the checkpoint alone; nor
``plan`` (:mod:`earl_lightning.planning.command`): it predicts the selector's choices from a config.

The omegaconf parser mode lets recipes interpolate (``${model.rollout.max_context_tokens}``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from jsonargparse import DefaultHelpFormatter

from earl_lightning.cli.argument_errors import ShortErrorParser
from earl_lightning.cli.fit import DUMP_HELP, EarlCLI  # noqa: F401 - public here too
from earl_lightning.core import console
from earl_lightning.core.errors import EarlError
from earl_lightning.core.warnings_filter import install_warning_filters
from earl_lightning.modules.datamodule import EpisodeDataModule
from earl_lightning.modules.rl import AgenticRLModule
from earl_lightning.parallel.faults import lost_peer_line

DESCRIPTION = """Agentic RL of LLMs (earl_lightning). Every subcommand:
  earl fit       train with RL (GRPO, PPO, ...) on an environment or a dataset
  earl validate  evaluate a model or a checkpoint
  earl sft       the warm start: supervised fine-tuning on demonstrations or TRL rows
  earl export    a checkpoint as a save_pretrained directory
  earl profile   measure the recipe's model per stage and layout
  earl plan      the layouts a model and cluster would run, without either (the time model)
  earl presets   the offline models (earl-tiny, ...): sizes, tokenizers, directories
Add --help after a subcommand for its options (test and predict are LightningCLI's own)."""


class DescribedHelp(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with :data:`DESCRIPTION` kept as written (one subcommand a line)."""


def working_directory_importable() -> None:
    """Import paths a recipe names (``my_rewards.format_reward``) are found in the working
    directory, as under ``python -m``: the ``earl`` script's own directory is the one Python puts
    on the path. Appended last, so an installed package of the same name still wins."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def own_command(name: str) -> Callable[[list[str]], None] | None:
    """The subcommand ``name`` when it is not a LightningCLI one (it parses its own arguments and
    needs no Lightning CLI), imported only when asked for; None for fit, validate, sft, ..."""
    if name == "profile":  # the recipe's model measured per stage and layout
        from earl_lightning.profiling.command import profile_command

        return profile_command
    if name == "presets":
        from earl_lightning.models.presets import presets_command

        return presets_command
    if name == "plan":  # config only
        from earl_lightning.planning.command import plan_command

        return plan_command
    if name == "export":  # the checkpoint says what to build
        from earl_lightning.checkpoints.export import export_command

        return export_command
    return None


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args is None:  # the `earl` script (a Python caller keeps its own path)
        working_directory_importable()
    install_warning_filters()  # again at each call: a caller's warnings.catch_warnings() may have reset them
    argv = sys.argv[1:] if args is None else list(args)
    command = own_command(argv[0]) if argv else None
    if command is not None:
        command(argv[1:])
        return
    try:
        if argv[:1] == ["sft"]:
            command_line = list(sys.argv)
            if args is None:  # LightningCLI reads sys.argv itself (and warns when given both)
                sys.argv = [sys.argv[0], *argv[1:]]
            from earl_lightning.cli.sft import sft

            sft(None if args is None else argv[1:], command_line if args is None else None)
            return
        EarlCLI(
            AgenticRLModule,
            EpisodeDataModule,
            parser_kwargs={
                "parser_mode": "omegaconf",
                "prog": "earl",
                "allow_abbrev": False,
                "description": DESCRIPTION,
                "formatter_class": DescribedHelp,
            },
            parser_class=ShortErrorParser,
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except EarlError as err:  # the user's to fix (an environment, a file): one line, no traceback
        console.error(f"earl: error: {err}")
        raise SystemExit(1) from None
    except Exception as err:
        # A peer lost in a collective no wrapper sees (Lightning's SIGTERM handler broadcasts when
        # torchrun stops the other ranks of a failed round): still one line.
        line = lost_peer_line(err)
        if line is None:
            raise
        console.error(f"earl: error: {line}")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
