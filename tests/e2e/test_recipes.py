"""Every recipe is parsed and smoke-run for 2 steps through the real `earl` CLI code path
(in-process for single-process recipes; multi-process ones through the `earl` command, since
Lightning launches the other ranks by re-running the command line). vLLM recipes run in tests/vllm."""

import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from earl_lightning.cli import main
from earl_lightning.modules import OptimConfig
from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

RECIPES = sorted(
    p
    for p in (Path(__file__).parents[2] / "recipes").glob("*.yaml")
    # the warm-start pipeline's recipes (*_sft, *_warm) are smoke-run by tests/e2e/test_sft.py, a
    # dataset task's (which need its data and warm start) by tests/e2e/test_dataset_tasks.py
    if "vllm" not in p.name
    and not p.stem.endswith(("_sft", "_warm"))
    and "dataset" not in yaml.safe_load(p.read_text())["data"]
)


def run_recipe(recipe: Path, args: list[str]) -> None:
    devices = yaml.safe_load(recipe.read_text())["trainer"].get("devices", 1)
    if devices == 1:
        main(args)
        return
    earl = Path(sys.executable).with_name("earl")
    proc = run_earl_process(
        [str(earl), *args], env=subprocess_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def smoke_args(recipe: Path, root: Path) -> list[str]:
    return [
        "fit",
        "--config",
        str(recipe),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
        "--data.batch_size",
        "8",
        "--data.group_size",
        "4",
        "--data.eval_episodes",
        "4",
    ]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_smoke_runs_two_steps(recipe, tmp_path):
    cfg = yaml.safe_load(recipe.read_text())
    assert {"trainer", "model", "data"} <= set(cfg), f"{recipe.name} lacks a section"
    run = recipe
    if "adaptive" in recipe.name:  # the fit-start profile within 10 s, not the recipe's 45
        for callback in cfg["trainer"]["callbacks"]:
            if "profile_budget_s" in callback.get("init_args", {}):
                callback["init_args"]["profile_budget_s"] = 10
        run = tmp_path / recipe.name
        run.write_text(yaml.safe_dump(cfg))
    run_recipe(run, smoke_args(run, tmp_path))
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard events written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "reward/mean",
        "env/invalid_rate",
        "context/mean",
        "stage/rollout/seconds",
        "loss/policy",
        "grad_norm",
        "logprob/mismatch",
        "val/win_rate" if "calculator" not in recipe.name else "val/reward",
    ):
        assert tag in tags, f"{tag} not logged by {recipe.name}; got {sorted(tags)}"
    steps = [e.step for e in acc.Scalars("reward/mean")]
    assert len(steps) == 2
    mismatch = [e.value for e in acc.Scalars("logprob/mismatch")]
    assert max(mismatch) < 1e-4, "rollout and recomputed log-probs disagree"
    assert list(tmp_path.rglob("last.ckpt")) or list(tmp_path.rglob("*.ckpt"))
    if "adaptive" not in recipe.name:  # fixed layouts (or none) train at the recipe's budget
        resolved = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)  # ${...} as earl
        want = resolved["model"].get("optim", {}).get("micro_batch_tokens")
        budgets = {e.value for e in acc.Scalars("stage/train/micro_batch_tokens")}
        assert budgets == {float(want or OptimConfig().micro_batch_tokens)}, recipe.name
    # profiled at fit start, saved under the run's root, decisions logged
    if "adaptive" in recipe.name:
        assert (tmp_path / "profile" / "profile.json").is_file()
        assert {
            "layout/train/activation_checkpointing",
            "layout/rollout/tp",
            "layout/train/predicted_mib",
        } <= tags
