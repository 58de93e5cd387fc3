"""``earl`` command line: LightningCLI over :class:`AgenticRLModule` and :class:`EpisodeDataModule`.

    earl fit --config recipes/connect4_ppo.yaml --trainer.max_steps 5
    earl validate --config recipes/connect4_ppo.yaml --ckpt_path last
    earl profile --config recipes/connect4_grpo.yaml --out profiles/connect4 --budget-s 300

``profile`` is not a LightningCLI subcommand: it measures the recipe's model per stage and layout
(:mod:`earl_lightning.profiling.stages`) for ``AdaptiveParallelism(profile=...)``.

The omegaconf parser mode lets recipes interpolate (``${model.max_new_tokens}``).
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from earl_lightning.callbacks import StepProgressBar
from earl_lightning.data.datamodule import EpisodeDataModule
from earl_lightning.modules.rl import AgenticRLModule
from earl_lightning.warnings_filter import install_warning_filters

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

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # The step-counting bar is the default, added here rather than through `trainer_defaults`
        # (which LightningCLI appends to every run): a recipe's own progress bar wins, and
        # `--trainer.enable_progress_bar false` still means no bar.
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs.setdefault("callbacks", [*callbacks, StepProgressBar()])
        return super().instantiate_trainer(**kwargs)


def profile_command(argv: list[str]) -> None:
    """``earl profile``: argument parsing; the work is :func:`earl_lightning.profiling.stages.profile_recipe`."""
    import argparse

    from earl_lightning.profiling.stages import profile_recipe

    parser = argparse.ArgumentParser(prog="earl profile", description=(
        "Measure each RL stage's tokens/s per context length x number of sequences x layout for a recipe's "
        "model; writes profile.json and one heatmap PNG per stage. On one process only dp1xtp1 is measured: "
        "launch under `torchrun --nproc-per-node N` to profile every dp x tp of N."))
    parser.add_argument("--config", required=True, help="the recipe YAML (its model.* and data.batch_size are used)")
    parser.add_argument("--out", default=None, help="output directory (default: profiles/<recipe name>)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="stop measuring after this many seconds")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="context lengths (default: powers of 4 from 256 to model.max_context_tokens)")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=None, help="sequences per step (default: "
                                                                                "data.batch_size)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median counts")
    ns = parser.parse_args(argv)
    try:
        profile_recipe(ns.config, out=ns.out, budget_s=ns.budget_s, contexts=ns.contexts, num_seqs=ns.num_seqs,
                       repeats=ns.repeats, log=print)
    except (ValueError, FileNotFoundError) as err:
        print(f"earl profile: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    install_warning_filters()  # again at each call: a caller's warnings.catch_warnings() may have reset them
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["profile"]:
        profile_command(argv[1:])
        return
    EarlCLI(
        AgenticRLModule,
        EpisodeDataModule,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
