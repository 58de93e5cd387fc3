"""The chaos run: a 2-process run that must finish, with nothing lost, while things go wrong.

    python scripts/chaos.py                    # 200 steps (about 15-25 min on 2 CPU cores)
    python scripts/chaos.py --steps 40 --kill-step 7 --stop-step 18 --disk-step 29   # a short one

``recipes/connect4_grpo_layouts.yaml`` (EarlStrategy: rollout tp 2, experience and train dp 2,
sharded DCP checkpoints) on 2 gloo processes under ``torchrun --max-restarts 3 ... --ckpt_path
last``, a checkpoint every ``--every`` steps. Injected:

- environment faults, seeded (``scripts/chaos_plugins.FlakyEnv``): 3% of episodes raise in a
  ``step``, 1% hang in one (6 s, past the run's ``env_timeout_s`` of 2 s); the environments run
  under ``call_isolation: process``, so a hung call kills its worker process and the episodes that
  shared it are rebuilt in a fresh one;
- a reward function that hangs (``chaos_plugins.hangs_on_some_rows``, weight 0): on about 1 row
  in 40 it never returns, and ``reward_timeout_s`` (2 s) interrupts it: that row and the rows
  after it fail as unscored;
- rank 1 SIGKILLed at the start of step ``--kill-step``;
- rank 1 SIGSTOPped (alive and silent) at the start of step ``--stop-step``; rank 0's collective
  times out after ``collective_timeout_s`` and it stops with one line, torchrun then ends the round;
- rank 0 fills the checkpoint filesystem (a ``--disk-mib`` tmpfs mounted for the run; needs root,
  otherwise this fault is left out and the report says so) before the save of step
  ``--disk-step + 1``; the next round frees the space at set-up.

The reference is the same run with the same environment and reward faults and nothing else, one
round. The
chaos run's final parameters must equal the reference's bit for bit, and so must every per-step
metric. Writes ``--csv`` (``docs/experiments/results/chaos.csv``; one row: what was injected, restarts, error lines, wall
times, time lost) and prints it; exit status 1 when the runs differ or a run did not finish.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "connect4_grpo_layouts.yaml"
ENV_TIMEOUT_S, HANG_S, COLLECTIVE_TIMEOUT_S, REWARD_TIMEOUT_S = 2.0, 6.0, 30, 2.0
COMPARED = ("reward/mean", "loss/policy", "grad_norm", "env/errors", "rewards/errors")


def overrides(run: Path, args: argparse.Namespace, chaos: bool) -> Path:
    ckpt = run / "checkpoints"
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": str(ckpt),
                "save_last": True,
                "every_n_train_steps": args.every,
            },
        }
    ]
    if chaos:
        callbacks += [
            {
                "class_path": "tests.plugins.faults.KillRank",
                "init_args": {
                    "rank": 1,
                    "step": args.kill_step,
                    "marker": str(run / "killed.marker"),
                },
            },
            {
                "class_path": "chaos_plugins.StopRank",
                "init_args": {
                    "rank": 1,
                    "step": args.stop_step,
                    "marker": str(run / "stopped.marker"),
                },
            },
        ]
        if args.disk:
            callbacks.append(
                {
                    "class_path": "chaos_plugins.FillDisk",
                    "init_args": {
                        "dirpath": str(ckpt),
                        "step": args.disk_step,
                        "marker": str(run / "disk.marker"),
                    },
                }
            )
    inner = {"opponent": "random", "seat": "alternate", "legal_move_reward": 0.02}
    path = run / "over.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "max_steps": args.steps,
                    "limit_val_batches": 0,
                    "enable_progress_bar": False,
                    "log_every_n_steps": 1,
                    "default_root_dir": str(run),
                    "callbacks": callbacks,
                    "strategy": {"init_args": {"collective_timeout_s": COLLECTIVE_TIMEOUT_S}},
                },
                "model": {
                    "rollout": {
                        "env_timeout_s": ENV_TIMEOUT_S,
                        "call_isolation": "process",
                        "reward_timeout_s": REWARD_TIMEOUT_S,
                    }
                },
                "data": {
                    "env": "chaos_plugins.FlakyEnv",
                    "eval_env_kwargs": None,
                    "batch_size": 8,
                    "group_size": 4,
                    "eval_episodes": 0,
                    "reward_funcs": ["chaos_plugins.hangs_on_some_rows"],
                    "reward_weights": [0.0],
                    "env_kwargs": {
                        "inner": "connect_four",
                        "inner_kwargs": inner,
                        "hang_s": HANG_S,
                    },
                },
            }
        )
    )
    return path


def launch(run: Path, args: argparse.Namespace, chaos: bool) -> tuple[int, float, str]:
    run.mkdir(parents=True, exist_ok=True)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3" if chaos else "0",
        "-m",
        "earl_lightning.cli",
        "fit",
        "--config",
        str(RECIPE),
        "--config",
        str(overrides(run, args, chaos)),
        "--ckpt_path",
        "last",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]),
        "OMP_NUM_THREADS": "1",
    }
    log = run / "launch.log"
    start = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        ).returncode
    return code, time.monotonic() - start, log.read_text()


def final_state(run: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, float]]]:
    """The last checkpoint's parameters and every per-step scalar (a later round's logger version
    overrides the steps it repeated)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / "last.ckpt", run / "last.pt")
    params = torch.load(run / "last.pt", weights_only=False)["state_dict"]
    scalars: dict[str, dict[int, float]] = {}
    for version in sorted(
        (run / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1])
    ):
        acc = EventAccumulator(str(version), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return params, scalars


def differences(ref: Path, chaos: Path, steps: int) -> tuple[list[str], tuple[float, float]]:
    """What differs between the two runs, and the faults the chaos run counted (``env/errors``,
    ``rewards/errors``)."""
    pa, sa = final_state(ref)
    pb, sb = final_state(chaos)
    found = [f"parameters differ: {k}" for k in pa if k not in pb or not torch.equal(pa[k], pb[k])]
    for tag in COMPARED:
        if sa.get(tag) != sb.get(tag) or len(sa.get(tag, {})) != steps:
            found.append(
                f"metric {tag} differs ({len(sa.get(tag, {}))} vs {len(sb.get(tag, {}))} steps)"
            )
    return found, (
        sum(sb.get("env/errors", {}).values()),
        sum(sb.get("rewards/errors", {}).values()),
    )


def mount_tmpfs(path: Path, mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="a checkpoint every this many steps")
    p.add_argument("--kill-step", type=int, default=47)
    p.add_argument("--stop-step", type=int, default=113)
    p.add_argument(
        "--disk-step", type=int, default=169, help="the disk fills before the save of step N+1"
    )
    p.add_argument("--disk-mib", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos")
    p.add_argument(
        "--csv", type=Path, default=ROOT / "docs" / "experiments" / "results" / "chaos.csv"
    )
    args = p.parse_args()
    if (args.disk_step + 1) % args.every:
        p.error(
            f"--disk-step {args.disk_step}: the save after it must be a checkpoint step "
            f"(--disk-step + 1 a multiple of --every {args.every})"
        )
    ref_dir, chaos_dir = args.out / "reference", args.out / "chaos"
    for d in (ref_dir, chaos_dir):
        if d.exists():
            subprocess.run(["umount", str(d / "checkpoints")], capture_output=True)
            subprocess.run(["rm", "-rf", str(d)], check=True)
    args.disk = mount_tmpfs(chaos_dir / "checkpoints", args.disk_mib)
    try:
        ref_code, ref_s, _ = launch(ref_dir, args, chaos=False)
        code, chaos_s, log = launch(chaos_dir, args, chaos=True)
        found, (env_errors, reward_errors) = (
            differences(ref_dir, chaos_dir, args.steps)
            if code == 0 == ref_code
            else (["a run did not finish"], (float("nan"), float("nan")))
        )
    finally:
        if args.disk:
            subprocess.run(["umount", str(chaos_dir / "checkpoints")], capture_output=True)
    errors = [
        line.split("earl: error: ", 1)[1][:200]
        for line in log.splitlines()
        if "earl: error: " in line
    ]
    row = {
        "steps": args.steps,
        "every": args.every,
        "kill_step": args.kill_step,
        "stop_step": args.stop_step,
        "disk_step": args.disk_step if args.disk else "not injected (needs root for a tmpfs)",
        "env_faults_counted": env_errors,
        "reward_rows_failed": reward_errors,
        "restarts": len(re.findall(r"failed \(exitcode", log)),
        "resumed_from_checkpoint": len(re.findall(r"Restored all states from the checkpoint", log)),
        "error_lines": " | ".join(errors),
        "reference_exit": ref_code,
        "chaos_exit": code,
        "reference_s": round(ref_s, 1),
        "chaos_s": round(chaos_s, 1),
        "lost_s": round(chaos_s - ref_s, 1),
        "equal": not found,
        "differences": "; ".join(found),
    }
    from _rows import report_rows

    report_rows([row], args.csv)
    sys.exit(0 if not found else 1)


if __name__ == "__main__":
    main()
