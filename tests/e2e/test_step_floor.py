"""``benchmarks/step_floor.py``: what it counts as operator time and as overhead, the ratio it reads
from a ``vs_trl.py`` CSV, and an end-to-end run that writes its CSV. Timing is not asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.step_floor import (
    FAULT_SLACK,
    StageProfiler,
    category,
    fewest_faults,
    measured_ratio,
    op_seconds,
)


def test_profiler_events_fall_into_attention_matmul_other_or_none():
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert {category(f"aten::{op}") for op in ("mm", "addmm", "bmm", "baddbmm")} == {"matmul"}
    assert category("aten::mul") == category("aten::silu_backward") == "other_ops"
    # record_function ranges and autograd's nodes hold Python / bookkeeping time, not an operator's
    assert category("Optimizer.step#AdamW.step") is None
    assert category("autograd::engine::evaluate_function: MmBackward0") is None
    assert op_seconds(
        {"aten::mm": 1.0, "aten::addmm": 0.5, "aten::mul": 0.25, "Optimizer.step#AdamW.step": 9.0}
    ) == {"attention": 0.0, "matmul": 1.5, "other_ops": 0.25}


def test_python_time_is_overhead_and_operator_time_is_not():
    a = torch.randn(256, 256)

    def work():
        time.sleep(0.05)  # pure Python / OS time: no operator
        for _ in range(20):
            a @ a

    prof = StageProfiler(work, warmup=1)
    prof()  # the warm-up call is not profiled
    assert prof.profiled == []
    prof()
    [call] = prof.profiled
    ops = call["attention"] + call["matmul"] + call["other_ops"]
    assert call["matmul"] > 0 and call["attention"] == 0
    assert call["wall"] >= 0.05 + ops * 0.99  # the sleep is outside every operator
    assert call["page_faults"] >= 0


def test_profiled_calls_that_took_page_faults_are_left_out():
    # A call that grew the heap (tens of thousands of first touches) has its fault time inside its
    # operators; the figures come from the calls with the fewest faults.
    calls = [
        {"page_faults": 60000.0, "wall": 2.2},
        {"page_faults": 2400.0, "wall": 1.9},
        {"page_faults": 85000.0, "wall": 2.3},
        {"page_faults": 2400.0 + FAULT_SLACK, "wall": 1.95},
    ]
    assert fewest_faults(calls) == [calls[1], calls[3]]
    assert fewest_faults(calls[:1]) == calls[:1]  # a single call is used whatever its faults


def test_ratio_comes_from_the_multi_turn_rows_and_a_missing_row_is_named(tmp_path):
    good = tmp_path / "vs_trl.csv"
    good.write_text(
        "side,mode,completion_len,turns,seconds_per_step\n"
        "earl,single,8,1,0.1\ntrl,single,8,1,0.3\nearl,multi,8,10,2.0\ntrl,multi,8,10,5.0\n"
    )
    assert measured_ratio(good, 8, 10) == pytest.approx(2.5)
    assert measured_ratio(None, 8, 10) is None
    with pytest.raises(
        SystemExit,
        match=r"--trl-csv .*vs_trl.csv.* no earl and TRL multi-turn rows for 12 turns "
        r"of 8 tokens \(found sides: none\)",
    ):
        measured_ratio(good, 8, 12)


def test_script_writes_its_csv_and_names_a_bad_argument(tmp_path):
    script = str(ROOT / "benchmarks" / "step_floor.py")
    bad = subprocess.run(
        [sys.executable, script, "--steps", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "--steps must be >= 1, got 0" in bad.stderr
    trl = tmp_path / "vs_trl.csv"
    trl.write_text(
        "side,mode,completion_len,turns,seconds_per_step\nearl,multi,4,2,1.0\ntrl,multi,4,2,3.0\n"
    )
    out = tmp_path / "floor.csv"
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--batch",
            "4",
            "--group",
            "2",
            "--turns",
            "2",
            "--reply-len",
            "4",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--trl-csv",
            str(trl),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = {r["what"]: float(r["value"]) for r in csv.DictReader(f)}
    for stage in ("rollout", "train"):
        assert rows[f"{stage}_calls_used"] == 1 and rows[f"{stage}_page_faults"] >= 0
        assert rows[f"{stage}_matmul"] > 0 and rows[f"{stage}_attention"] > 0
        assert rows[f"{stage}_ops"] == pytest.approx(
            rows[f"{stage}_attention"] + rows[f"{stage}_matmul"] + rows[f"{stage}_other_ops"],
            rel=1e-3,
        )
    assert rows["vs_trl_ratio_measured"] == pytest.approx(3.0)
    assert rows["vs_trl_ratio_bound_no_overhead"] == pytest.approx(
        3.0 * rows["two_stages_wall"] / rows["two_stages_ops"], rel=1e-2
    )
