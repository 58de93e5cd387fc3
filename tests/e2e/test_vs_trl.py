"""``benchmarks/vs_trl.py`` smoke-run: both sides (earl_lightning, TRL's GRPOTrainer) and both
modes (single-turn, multi-turn through TRL's ``rollout_func``) for 2 RL steps each, in fresh
processes, writing the CSVs. Timing is not asserted; the values must be sane. Plus the pieces the
fairness of the comparison rests on: the TRL multi-turn path builds the chat exactly as the
template renders it, and bad arguments fail with a clear message."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the smallest work that still has two GRPO groups a step and a multi-turn episode of several turns
BATCH, GROUP, LENGTH, TURNS = 8, 4, 8, 2


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("vs_trl") / "vs_trl.csv"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "vs_trl.py"),
        "--quick",
        "--runs",
        "1",
        "--steps",
        "2",
        "--multi-steps",
        "2",
        "--warmup",
        "1",
        "--lengths",
        str(LENGTH),
        "--multi-length",
        str(LENGTH),
        "--turns",
        str(TURNS),
        "--batch",
        str(BATCH),
        "--group",
        str(GROUP),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def read(path: Path) -> list[dict]:
        with path.open() as f:
            return list(csv.DictReader(f))

    return (
        read(out),
        read(out.with_name("vs_trl_runs.csv")),
        proc.stdout,
        read(out.with_name("vs_trl_ratios.csv")),
    )


def test_csv_has_both_sides_and_modes_with_sane_values(smoke):
    rows, runs, stdout, ratios = smoke
    assert list(rows[0])[:7] == [
        "side",
        "mode",
        "completion_len",
        "turns",
        "seconds_per_step",
        "tokens_per_s",
        "peak_rss_mib",
    ]
    assert sorted((r["side"], r["mode"]) for r in rows) == [
        ("earl", "multi"),
        ("earl", "single"),
        ("trl", "multi"),
        ("trl", "single"),
    ]
    assert len(runs) == 4
    for r in rows:
        turns = TURNS if r["mode"] == "multi" else 1
        assert int(r["turns"]) == turns and int(r["completion_len"]) == LENGTH
        assert float(r["seconds_per_step"]) > 0 and float(r["tokens_per_s"]) > 0
        assert 100 < float(r["peak_rss_mib"]) < 64 * 1024
        # every reply is at most LENGTH tokens; eos may end one early
        assert 0.5 * BATCH * LENGTH * turns <= float(r["tokens_per_step"]) <= BATCH * LENGTH * turns
        assert 0.0 <= float(r["reward_first"]) <= 1.0 and 0.0 <= float(r["reward_last"]) <= 1.0
    assert all(0 < float(r["cpu_share"]) < 2 and float(r["guard_s"]) > 0 for r in runs)
    # both sides split their step: earl's rollout and train stages, TRL's generation and the rest of
    # its training_step; the parts are timed inside the step, so they add up to at most its wall
    for r in runs:
        rollout, train = float(r["rollout_s"]), float(r["train_s"])
        assert (
            rollout > 0 and train > 0 and rollout + train <= 1.01 * float(r["seconds_per_step"])
        ), r
    assert "TRL generation s" in stdout
    assert all(float(r["rollout_speedup"]) > 0 and float(r["train_speedup"]) > 0 for r in ratios)
    assert "earl speed / TRL" in stdout and "machine-speed guard" in stdout
    # one run per side: the one pair's ratio is the ratio of the medians, unless the machine-speed
    # guard flagged one of its runs (a busy CI machine), which leaves no pair
    assert sorted(r["mode"] for r in ratios) == ["multi", "single"]
    for r in ratios:
        flagged = any(x["slow_machine"] == "True" for x in runs if x["mode"] == r["mode"])
        assert r["pair"] == "earl / trl" and int(r["pairs"]) == (0 if flagged else 1)
        if not flagged:
            assert (
                float(r["ratio_min"])
                == float(r["ratio_max"])
                == pytest.approx(float(r["speedup"]), rel=1e-3)
            )


def test_trl_turn_tokens_match_the_chat_template():
    from benchmarks.vs_trl_sides import _trl_turn_text
    from earl_lightning.models import load_tokenizer

    tok = load_tokenizer("earl-tiny")
    msgs = [{"role": "user", "content": "Request 01. Turn 1/3."}]
    first = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    reply = "12a4"
    whole = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "3 digits."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    expected = tok.encode(whole[len(first) + len(reply) :], add_special_tokens=False)
    assert _trl_turn_text(tok, "3 digits.", ended_eos=False) == expected
    # the sampled eos is <|im_end|>
    assert _trl_turn_text(tok, "3 digits.", ended_eos=True) == expected[1:]
    assert expected[0] == tok.eos_token_id


def test_envs_score_digits_per_token_budget():
    from benchmarks.vs_trl_env import DigitTurns, PromptTask, digit_reward

    assert digit_reward("12ab", 8) == 0.25 and digit_reward("1" * 20, 8) == 1.0
    task = PromptTask(completion_len=4)
    assert task.reset(65) == task.reset(1)
    assert task.step("9x9x").reward == 0.5 and task.step("").done
    game = DigitTurns(completion_len=4, turns=2)
    assert game.reset(3).endswith("Turn 1/2.")
    first = game.step("1234")
    assert (first.reward, first.done, first.observation) == (
        0.5,
        False,
        "4 digits. Turn 2/2: more digits.",
    )
    assert game.step("").done
    with pytest.raises(RuntimeError, match="after the episode ended"):
        game.step("1")
    with pytest.raises(ValueError, match="`turns` must be an integer >= 1"):
        DigitTurns(turns=0)


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--warmup", "5", "--steps", "5"],
            r"--warmup \(5\) must be >= 0 and smaller than --steps \(5\)",
        ),
        (["--batch", "60"], r"--batch \(60\) must be a multiple of --group \(8\)"),
        (["--modes", "single", "chat"], r"--modes: unknown \['chat'\]"),
        (["--runs", "0"], r"--runs must be >= 1, got 0"),
        (["--lr", "0"], r"--lr must be > 0"),
    ],
    ids=["warmup", "batch", "modes", "runs", "lr"],
)
def test_bad_arguments_fail_with_a_message(argv, match, capsys):
    from benchmarks.vs_trl import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


def test_host_memory_sides_pair_and_run_with_their_malloc_settings(monkeypatch):
    """``--host-memory``: each side runs in a process with its own malloc setting (nothing inherited
    from the caller), and the ratio is taken for earl / TRL, earl / TRL with earl's setting and
    earl with glibc's / TRL."""
    import json

    import benchmarks.vs_trl as vs

    seen = []

    def fake_run(cmd, env, **kwargs):
        seen.append(
            (
                json.loads(cmd[-1])["side"],
                {k: v for k, v in env.items() if k.startswith(("EARL_HOST", "MALLOC_"))},
            )
        )
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="stop")

    monkeypatch.setenv("EARL_HOST_MEMORY", "glibc")  # the caller's must not leak into a side
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "7")
    monkeypatch.setattr(vs.subprocess, "run", fake_run)
    args = vs.parse_args(["--quick", "--host-memory"])
    sides = ("earl", "trl", "earl_glibc", "trl_retain")
    for side in sides:
        with pytest.raises(RuntimeError, match=f"the {side} run"):
            vs.run_side(side, vs.configs(args)[0], args)
    assert dict(zip(sides, seen)) == {
        "earl": ("earl", {"EARL_HOST_MEMORY": "retain"}),
        "trl": ("trl", {}),
        "earl_glibc": ("earl", {"EARL_HOST_MEMORY": "glibc"}),
        "trl_retain": ("trl", {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}),
    }

    def row(side, sec):
        return {
            "side": side,
            "mode": "multi",
            "completion_len": 8,
            "turns": 10,
            "seconds_per_step": sec,
            "tokens_per_step": 100.0,
            "reward_first": 0.1,
            "reward_last": 0.2,
            "only_flagged": False,
        }

    checks = vs.verdicts(
        [row("earl", 1.0), row("trl", 4.0), row("earl_glibc", 2.0), row("trl_retain", 3.0)]
    )
    assert {c["pair"]: c["speedup"] for c in checks} == {
        "earl / trl": 4.0,
        "earl / trl_retain": 3.0,
        "earl_glibc / trl": 2.0,
    }


def test_paired_ratios_take_each_run_s_two_sides_and_skip_flagged_runs():
    """The run-by-run ratios pair the earl and TRL runs of one run index at one point; a run the
    machine-speed guard flagged drops its pair; other points and sides do not mix in."""
    import benchmarks.vs_trl as vs

    def run(i, side, sec, slow=False, turns=10):
        return {
            "run": i,
            "side": side,
            "mode": "multi",
            "completion_len": 8,
            "turns": turns,
            "seconds_per_step": sec,
            "slow_machine": slow,
        }

    rows = [
        run(0, "earl", 2.0),
        run(0, "trl", 7.0),
        run(1, "trl", 9.0),
        run(1, "earl", 3.0),
        run(2, "earl", 2.0, slow=True),
        run(2, "trl", 8.0),
        run(3, "earl", 2.5),
        run(3, "trl_retain", 5.0),
        run(4, "earl", 1.0, turns=5),
        run(4, "trl", 9.0, turns=5),
    ]
    assert vs.paired_ratios(rows, "earl", "trl", ("multi", 8, 10)) == [3.5, 3.0]
    summary = [
        {
            "side": s,
            "mode": "multi",
            "completion_len": 8,
            "turns": 10,
            "seconds_per_step": sec,
            "tokens_per_step": 100.0,
            "reward_first": 0.1,
            "reward_last": 0.2,
            "only_flagged": False,
        }
        for s, sec in (("earl", 2.5), ("trl", 8.0))
    ]
    (check,) = vs.verdicts(summary, rows)
    assert (check["speedup"], check["pairs"], check["ratio_min"], check["ratio_max"]) == (
        3.2,
        2,
        3.0,
        3.5,
    )
