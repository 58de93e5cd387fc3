"""``benchmarks/vs_trl_sets.py``: recorded ``vs_trl.py`` run sets read back, their ratios (of the
medians and run by run) recomputed exactly, the settled rule (every one of enough pairs at the
target), and clear errors for bad input."""

from __future__ import annotations

import csv
import math
import re

import pytest

from benchmarks.vs_trl import RUN_COLUMNS, write_csv
from benchmarks.vs_trl_sets import main, read_runs, recorded_order


def _run(
    run: int, side: str, mode: str, seconds: float, *, slow: bool = False, turns: int = 10
) -> dict:
    return {
        "run": run,
        "side": side,
        "mode": mode,
        "completion_len": 8,
        "turns": turns if mode == "multi" else 1,
        "seconds_per_step": seconds,
        "tokens_per_s": 100.0,
        "peak_rss_mib": 900.0,
        "tokens_per_step": 500.0,
        "reward_first": 0.1,
        "reward_last": 0.3 if side == "earl" else 0.25,
        "guard_s": 0.1 if slow else 0.04,
        "slow_machine": slow,
        "load_before": 1.0,
        "load_after": 1.0,
        "cpu_share": 0.95,
        "rollout_s": 0.5 if side == "earl" else "",
        "experience_s": 0.0 if side == "earl" else "",
        "train_s": 1.0 if side == "earl" else "",
        "peak_gpu_mib": 0,
    }


def _read(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_sets_recompute_ratios_and_settle_only_when_every_pair_reaches_the_target(tmp_path, capsys):
    # set A: multi-turn, 5 pairs all >= 3x -> settled at 97%; single-turn 8 tokens: 2 pairs, too few
    a = [
        _run(i, s, "multi", sec)
        for i, (e, t) in enumerate([(1, 3.2), (1, 3.5), (2, 6.4), (1, 3.0), (1, 4.0)])
        for s, sec in (("earl", e), ("trl", t))
    ]
    a += [
        _run(i, s, "single", sec)
        for i, (e, t) in enumerate([(0.1, 0.2), (0.1, 0.25)])
        for s, sec in (("earl", e), ("trl", t))
    ]
    # set B: multi-turn, one pair below 3x, and a flagged run (its pair dropped, its run out of the medians)
    b = [
        _run(0, "earl", "multi", 1.0),
        _run(0, "trl", "multi", 2.9),
        _run(1, "earl", "multi", 1.0),
        _run(1, "trl", "multi", 3.3),
        _run(2, "earl", "multi", 5.0, slow=True),
        _run(2, "trl", "multi", 3.1),
    ]
    write_csv(tmp_path / "vs_trl_a_runs.csv", a, RUN_COLUMNS)
    write_csv(tmp_path / "vs_trl_b_runs.csv", b, RUN_COLUMNS)
    out = tmp_path / "sets.csv"
    assert (
        main(
            [
                str(tmp_path / "vs_trl_a_runs.csv"),
                str(tmp_path / "vs_trl_b_runs.csv"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = {(r["set"], r["mode"]): r for r in _read(out)}
    ma, sa, mb = rows["vs_trl_a", "multi"], rows["vs_trl_a", "single"], rows["vs_trl_b", "multi"]
    assert ma["ratios"] == "3.20 3.50 3.20 3.00 4.00" and float(ma["speedup"]) == pytest.approx(
        3.5 / 1
    )
    assert (ma["pairs"], ma["pairs_at_target"], ma["settled"]) == ("5", "5", "True")
    assert float(ma["confidence"]) == pytest.approx(1 - 2**-5, abs=1e-3)
    assert (sa["ratios"], sa["pairs_at_target"], sa["settled"], float(sa["target"])) == (
        "2.00 2.50",
        "2",
        "False",
        1.5,
    )
    assert math.isnan(float(sa["confidence"]))
    # B: medians over unflagged runs: earl 1.0, TRL median(2.9, 3.3, 3.1) = 3.1
    assert float(mb["speedup"]) == pytest.approx(3.1)
    assert (mb["ratios"], mb["pairs_at_target"], mb["settled"]) == ("2.90 3.30", "1", "False")
    assert (mb["runs_earl"], mb["runs_trl"]) == ("2", "3")
    # every set's pairs pooled per point: 7 multi-turn pairs, one under 3x; the median pair 3.2
    pm, ps = rows["all sets", "multi"], rows["all sets", "single"]
    assert pm["ratios"] == "2.90 3.00 3.20 3.20 3.30 3.50 4.00" and float(
        pm["speedup"]
    ) == pytest.approx(3.2)
    assert (pm["pairs"], pm["pairs_at_target"], pm["settled"], pm["runs_earl"]) == (
        "7",
        "6",
        "False",
        "7",
    )
    assert (ps["pairs"], ps["settled"]) == ("2", "False")  # all at 1.5x, but fewer than 5
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| vs_trl_a | multi | 8 | 10 |" in printed and "5/5 of 3x | yes |" in printed


def test_host_memory_sides_are_left_out_of_the_earl_trl_rows(tmp_path):
    rows = [
        _run(0, s, "multi", sec)
        for s, sec in (("earl", 1.0), ("trl", 3.0), ("earl_glibc", 1.2), ("trl_retain", 2.5))
    ]
    write_csv(tmp_path / "hm_runs.csv", rows, RUN_COLUMNS)
    out = tmp_path / "sets.csv"
    main([str(tmp_path / "hm_runs.csv"), "--min-pairs", "1", "--out", str(out)])
    got = _read(out)
    assert [(r["set"], r["ratios"], r["settled"]) for r in got] == [
        ("hm", "3.00", "True"),
        ("all sets", "3.00", "True"),
    ]
    assert read_runs(tmp_path / "hm_runs.csv")[0]["slow_machine"] is False


@pytest.mark.parametrize(
    "argv, match",
    [
        (["{tmp}/absent_runs.csv"], r"runs_files: no such file: .*absent_runs\.csv"),
        (["--min-pairs", "0"], r"--min-pairs must be >= 1, got 0"),
    ],
)
def test_bad_arguments_fail_with_a_message(tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit):
        main([a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--out", str(tmp_path / "o.csv")])
    assert re.search(match, capsys.readouterr().err)


def test_a_csv_that_is_not_a_runs_file_is_named_in_the_error(tmp_path, capsys):
    bad = tmp_path / "medians.csv"
    bad.write_text("side,mode\nearl,multi\n")
    with pytest.raises(SystemExit):
        main([str(bad), "--out", str(tmp_path / "o.csv")])
    assert re.search(
        r"runs_files: .*medians\.csv: not a vs_trl\.py runs CSV", capsys.readouterr().err
    )


def test_sets_default_to_the_order_they_were_recorded_in(tmp_path):
    """By the commit that added each file (what a fresh clone keeps), not by name; outside git by time."""
    import os
    import subprocess

    names = [
        "vs_trl_z_runs.csv",
        "vs_trl_a_runs.csv",
        "vs_trl_m_runs.csv",
    ]  # recorded in this order
    rows = [_run(0, s, "multi", sec) for s, sec in (("earl", 1.0), ("trl", 3.0))]
    for i, name in enumerate(names):
        write_csv(tmp_path / name, rows, RUN_COLUMNS)
        os.utime(tmp_path / name, (1_000_000 + i, 1_000_000 + i))
    assert [
        f.name for f in recorded_order(list(tmp_path.glob("*.csv")))
    ] == names  # no git here: by time
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    for i, name in enumerate(reversed(names)):  # committed in the other order; file times stay
        env = {**os.environ, "GIT_COMMITTER_DATE": f"@{2_000_000 + i} +0000"}
        subprocess.run(git + ["add", name], check=True)
        subprocess.run(git + ["commit", "-q", "-m", name], check=True, env=env)
    assert [f.name for f in recorded_order(list(tmp_path.glob("*.csv")))] == list(reversed(names))
