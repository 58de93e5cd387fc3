"""`earl plan` through the real command: Qwen2.5-72B's config on 16 x 8 H100s with the Connect Four
recipe writes its tables and plot, the selector moves the rollout from TP 4 to TP 8 where TP 4 runs
out of memory (the EARL paper's switch), and every bad input is one line with exit status 2."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import subprocess_env
from tests.earl_process import run_earl_process

ROOT = Path(__file__).resolve().parents[2]
Q72 = ROOT / "benchmarks" / "configs" / "qwen2.5-72b-instruct.json"
RECIPE = ROOT / "recipes" / "connect4_ppo.yaml"
EARL = Path(sys.executable).with_name("earl")


def earl_plan(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_earl_process(
        [str(EARL), "plan", *args],
        cwd=ROOT,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_the_72b_plan_switches_the_rollout_to_tp8_where_tp4_runs_out_of_memory(tmp_path):
    out = tmp_path / "plan"
    proc = earl_plan(
        "--model", str(Q72), "--cluster", "16x8xH100-80G", "--recipe", str(RECIPE),
        "--contexts", "4096,16384", "--dtype", "bfloat16", "--num-seqs", "512", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 16x8xH100-80G, 512 sequences per step" in proc.stdout
    adaptive = {(int(r["context"]), r["stage"]): r for r in read(out / "plan.csv")}
    assert set(adaptive) == {
        (c, s) for c in (4096, 16384) for s in ("rollout", "experience", "train")
    }
    for r in adaptive.values():
        assert r["fits"] == "True" and float(r["peak_gib"]) <= 0.9 * 79.6, r
    # 16 sequences a replica at 16K tokens: a TP 4 shard's KV cache does not fit, TP 8's does
    assert adaptive[(16384, "rollout")]["tp"] == "8"
    static = read(out / "plan_static.csv")
    tp4 = [r for r in static if r["stage"] == "rollout" and r["tp"] in ("1", "2", "4")]
    assert tp4 and all(r["fits"] == "False" for r in tp4 if r["context"] == "16384")
    summary = {r["policy"]: r for r in read(out / "plan_summary.csv")}
    assert summary["adaptive"]["oom_contexts"] == ""
    assert all(r["oom_contexts"] for p, r in summary.items() if "xtp4-" in p or "xtp1-" in p)
    assert (out / "plan.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--cluster", "16x8xH100-90G"],
            "`--cluster`: unknown device 'H100-90G'; known devices: "
            "['A100-40G', 'A100-80G', 'CPU', 'H100-80G', 'H200-141G', 'H800-80G']",
        ),
        (
            ["--cluster", "2x16xH100-80G"],
            "`--cluster` '2x16xH100-80G': a H100-80G node holds at most 8 devices, got 16 per node",
        ),
        (
            ["--cluster", "16x8xH100-80G", "--model", "CONFIG"],
            "lacks ['num_hidden_layers', 'num_attention_heads', 'intermediate_size']; the plan "
            "sizes a decoder-only LM from",
        ),
        (
            ["--cluster", "16x8xH100-80G", "--contexts", "32768:1024"],
            "`--contexts` must be A:B (doubling from A up to B) or a comma list such as "
            "1024,4096,32768, of increasing lengths of at least 2 tokens; got '32768:1024'",
        ),
        (
            ["--cluster", "16x8xH100-80G", "--train-layout", "dp3xtp1"],
            "`--train-layout` dp3xtp1 has dp*tp = 3, but the world size is 128",
        ),
    ],
    ids=[
        "unknown-gpu",
        "impossible-cluster",
        "config-without-fields",
        "bad-contexts",
        "bad-train-layout",
    ],
)
def test_a_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, args, message):
    """The first case through the real `earl` command; the others through its entry point in this
    process (the same `main`, without a second start-up of ~10-30 s each)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "vocab_size": 100}))
    args = [str(config) if a == "CONFIG" else a for a in args]
    model = [] if "--model" in args else ["--model", str(Q72)]
    argv = [*model, "--recipe", str(RECIPE), "--out", str(tmp_path / "o"), *args]
    if "H100-90G" in args[1]:
        proc = earl_plan(*argv)
        code, stderr = proc.returncode, proc.stderr
    else:
        from earl_lightning.cli import main

        with pytest.raises(SystemExit) as ended:
            main(["plan", *argv])
        code, stderr = ended.value.code, capsys.readouterr().err
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("earl: error: ") and message in lines[-1], stderr[-2000:]
    assert not (tmp_path / "o").exists()
