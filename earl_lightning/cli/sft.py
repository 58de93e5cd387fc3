"""``earl sft``: the warm start's command, :class:`EarlCLI` over the warm-start module and the
demonstrations' DataModule, with its own ``--output_dir`` and ``--overwrite``."""

from __future__ import annotations

import sys
import time
from typing import Optional

from earl_lightning.cli.argument_errors import ShortErrorParser
from earl_lightning.cli.fit import EarlCLI, disk_full_as_one_line, refuse

# ``earl sft``'s own top-level arguments: help text (also docs/configuration.md's rows)
SFT_ARGS = {
    "output_dir": "Directory the warm-start model is saved to (save_pretrained, atomically, by rank 0); required.",
    "overwrite": "Replace --output_dir when it exists and is not empty.",
}


class SftCLI(EarlCLI):
    """``earl sft``: the warm start. No subcommand: it fits, then saves the model and tokenizer to
    ``--output_dir`` (and ``warm_start.json``: the held-out evaluation and the demonstrations'
    figures), which ``earl fit --model.model <dir>`` loads."""

    def add_arguments_to_parser(self, parser) -> None:
        from jsonargparse import ActionYesNo

        parser.add_argument(
            "--output_dir",
            type=Optional[str],  # noqa: UP045 - a runtime type for jsonargparse
            default=None,
            help=SFT_ARGS["output_dir"],
        )
        parser.add_argument(
            "--overwrite", action=ActionYesNo, default=False, help=SFT_ARGS["overwrite"]
        )

    def before_instantiate_classes(self) -> None:
        from earl_lightning.sft.save import output_dir_problem

        super().before_instantiate_classes()
        config = self.config
        problem = output_dir_problem(
            config.get("output_dir"),
            bool(config.get("overwrite")),
            config["trainer"].get("default_root_dir"),
            config["model"].get("model"),
        )
        if problem is not None:
            refuse(problem)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # what the model and the data decide together, before the demonstrations are played: the
        # rollout settings with the data's tools and env (as check_data in fit), the first rows,
        # the evaluation interval against the epoch
        try:
            self.datamodule.check_rollout(self.model.rollout_config)
            self.datamodule.check_rows(self.model)
            self.datamodule.check_val_interval(self.trainer, self.model)
        except ValueError as err:
            refuse(str(err))


def sft(args: list[str] | None, command_line: list[str] | None = None) -> None:
    """``earl sft``. ``command_line``: the process's own ``sys.argv`` (with ``sft``), put back once
    the arguments are parsed: Lightning's launcher starts the other ranks by re-running it."""
    from earl_lightning.sft import DemonstrationDataModule, WarmStartModule
    from earl_lightning.sft.save import save_warm_start

    cli = SftCLI(
        WarmStartModule,
        DemonstrationDataModule,
        run=False,
        args=args,
        parser_class=ShortErrorParser,
        parser_kwargs={"parser_mode": "omegaconf", "prog": "earl sft", "allow_abbrev": False},
        save_config_kwargs={"overwrite": True},
    )
    if command_line is not None:
        sys.argv = command_line
    start = time.monotonic()
    with disk_full_as_one_line(
        lambda: f"the warm start's outputs under {cli.config['output_dir']!r}"
    ):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        if (
            cli.model.evaluated_at_step != cli.trainer.global_step
            and cli.datamodule.hparams.eval_episodes
        ):
            # the saved model's figures
            cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        save_warm_start(
            cli.trainer,
            cli.model,
            cli.datamodule,
            cli.config["output_dir"],
            time.monotonic() - start,
        )
