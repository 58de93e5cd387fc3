"""Probe (issue 16): the multi-turn rollout with the hf backend's forward under ``torch.compile``.

Runs earl's side of the multi-turn comparison in ``benchmarks/vs_trl.py`` (DigitTurns, 10 turns of
8 tokens, 64 episodes in groups of 8, earl-tiny, fp32, 2 threads) for ``STEPS`` RL steps with
every prefill and decode forward of the rollout (``HFBackend._forward``) either eager or through
``torch.compile(model, dynamic=True, mode=MODE)`` (inductor); training stays eager. Prints each
step's ``stage/rollout/seconds``, their median after 2 warm-up steps, and the rewards (equal
rewards: the compiled forward sampled the same tokens). A probe, one run per invocation: run the
sides one after another, alternating, on a quiet machine.

    python benchmarks/rollout_compile_probe.py eager 8
    python benchmarks/rollout_compile_probe.py default 8
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.vs_trl_sides import RunSpec, run_earl  # noqa: E402
from earl_lightning.rollout.backends import hf  # noqa: E402


def compile_rollout_forward(mode: str) -> None:
    """Route ``HFBackend._forward`` through one compiled module per rollout model."""
    compiled: dict[int, torch.nn.Module] = {}

    def _forward(self, ids, pos, mask, cache):
        if id(self.model) not in compiled:
            compiled[id(self.model)] = torch.compile(self.model, dynamic=True,
                                                     mode=None if mode == "default" else mode)
        self.stats["forwards"] += 1
        out = compiled[id(self.model)](input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                                       use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    hf.HFBackend._forward = _forward


def main() -> None:
    modes = ("eager", "default", "reduce-overhead", "max-autotune")
    args = sys.argv[1:]
    steps_ok = len(args) == 1 or (len(args) == 2 and args[1].isdigit() and int(args[1]) >= 3)
    if not args or args[0] not in modes or not steps_ok:
        raise SystemExit(f"usage: rollout_compile_probe.py MODE [STEPS]; MODE one of {', '.join(modes)}, "
                         f"STEPS an integer >= 3 (default 6); got {' '.join(args)!r}")
    mode, steps = args[0], int(args[1]) if len(args) == 2 else 6
    if mode != "eager":
        compile_rollout_forward(mode)
    torch.set_num_threads(2)
    out = run_earl(RunSpec(side="earl", mode="multi", completion_len=8, turns=10, steps=steps, warmup=2))
    rollout = [x["stage/rollout/seconds"] for x in out["stages"]]
    print(mode, "rollout per step", [round(r, 2) for r in rollout],
          "median after 2:", round(statistics.median(rollout[2:]), 3))
    print(mode, "rewards", [round(r, 3) for r in out["rewards"]])


if __name__ == "__main__":
    main()
