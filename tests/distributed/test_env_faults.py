"""Environment faults on 2 gloo processes: the failed share is over every rank's episodes (every
rank stops, or every rank trains on, never one alone), and a real 2-process `earl fit` on an env
that fails in some episodes completes and logs the global ``env/errors``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import run_distributed, subprocess_env
from tests.e2e.test_multiprocess import scalars, two_process_recipe
from tests.earl_process import run_earl_process

pytestmark = pytest.mark.distributed
P = "tests.plugins.faulty_envs."
ROOT = Path(__file__).parents[2]  # where `tests.plugins` is importable from


def play_and_check(rank: int, world: int, max_share: float) -> dict:
    """Rank 0 plays 4 episodes whose env fails at reset, rank 1 four healthy ones."""
    from transformers import AutoModelForCausalLM

    from earl_lightning.batches.episodes import episodes_to_experience
    from earl_lightning.core.errors import EnvironmentFailure
    from earl_lightning.models import load_tokenizer, make_tiny_model
    from earl_lightning.modules.metrics import RunMetrics
    from earl_lightning.parallel.collectives import Reducer
    from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
    from earl_lightning.stages import check_env_failures

    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))
    env = P + "RaisesInReset" if rank == 0 else "recall"
    specs = [
        EpisodeSpec(env, seed=10 * rank + i, group_id=i, episode_id=i, env_kwargs={"num_turns": 2})
        for i in range(4)
    ]
    episodes = rollout(
        specs,
        HFBackend(model, tok),
        tok,
        SamplingConfig(max_new_tokens=3, seed=rank),
        max_turns=2,
        max_context_tokens=1024,
    )
    out = {"failed": sum(ep.error is not None for ep in episodes)}
    try:
        check_env_failures(episodes, Reducer(), max_share, step=5)
    except EnvironmentFailure as err:
        out["stopped"] = str(err)
        return out
    out["env/errors"] = RunMetrics().step(episodes, True, episodes_to_experience(episodes), True)[
        "env/errors"
    ]
    return out


def test_half_the_episodes_failed_stops_every_rank():
    results = run_distributed(play_and_check, 2, 0.5, timeout=300)
    assert [r["failed"] for r in results] == [4, 0]
    assert "env/errors" not in results[0] and "env/errors" not in results[1]
    head = "4 of 8 episodes of RL step 5 failed inside the environment (`--model.rollout.max_failed_share` 0.5); "
    tail = ". Fix the environment, or raise max_failed_share to train through failures"
    assert results[0]["stopped"].startswith(head + "the first here: ")
    assert (
        f"env '{P}RaisesInReset' (seed 0): reset() raised OSError('reset broke'){tail}"
        in results[0]["stopped"]
    )
    assert results[1]["stopped"] == head + "see another rank's log for the errors" + tail


def test_a_share_under_one_trains_on_and_counts_errors_over_both_ranks():
    results = run_distributed(play_and_check, 2, 1.0, timeout=300)
    assert results == [{"failed": 4, "env/errors": 4.0}, {"failed": 0, "env/errors": 4.0}]


def test_earl_fit_on_two_processes_trains_through_env_faults(tmp_path):
    """Half of the groups (even seeds) fail at their second step; the run completes, the step's
    ``env/errors`` is the count over both ranks, and the fault is logged (once per process)."""
    recipe = two_process_recipe(
        tmp_path,
        P + "RaisesInStep",
        {"num_turns": 3, "lag": 0, "every": 2, "turn": 1},
        allowed="0123456789",
    )
    earl = Path(sys.executable).with_name("earl")
    proc = run_earl_process(
        [str(earl), "fit", "--config", str(recipe)],
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = scalars(tmp_path / "run")
    # training seeds 1000003 + 4 * step + group: two of each step's four groups of 4 are even
    assert s["env/errors"] == [8.0, 8.0]
    assert s["val/errors"][-1] == 4.0  # eval seeds 0..7
    first = re.findall(
        rf"\[rank (\d)\] env '{re.escape(P)}RaisesInStep' \(seed \d+\): step\(\) raised "
        r"RuntimeError\('step broke'\)\n\[logged once per kind of fault and process",
        proc.stderr,
    )
    assert sorted(first) == ["0", "1"], proc.stderr[
        -4000:
    ]  # once in each process (both had faults)
    assert 'raise RuntimeError("step broke")' in proc.stderr
