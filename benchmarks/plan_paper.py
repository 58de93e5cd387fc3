"""The EARL paper's setting through ``earl plan``: Qwen2.5-72B-Instruct on 16 nodes x 8 H100-80G,
the Connect Four recipe, rows growing from 1K to 32K tokens; the adaptive choice against every
static layout, and the model's figures beside the paper's (arXiv 2510.05943).

Nothing here is measured: it is the plan's memory model and time model (the H100 profile's
datasheet rates and stated efficiency assumptions). Four tables:

1. the plan at the recipe's 64 sequences per step and at 512 (``earl plan``'s own output: the
   adaptive choice per context and stage, every static policy's out-of-memory contexts and time);
2. rollout TP 4 against TP 8 per context: each one's seconds and peak memory per GPU, and how
   many responses one replica may hold at 32K before it runs out of memory (HF and vLLM backends);
3. the dispatcher: the all-to-all against gather-then-scatter at the paper's payloads (46, 93 and
   187 MiB per worker at 8K, 16K and 32K) on 16 and 128 workers.

    python benchmarks/plan_paper.py            # about a minute; writes benchmarks/results/plan_paper_*.csv

and ``benchmarks/results/plan_72b_{64,512}/`` (plan.csv, plan_static.csv, plan_summary.csv, plan.png).
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from earl_lightning.parallel.layout import Layout  # noqa: E402
from earl_lightning.planning.command import plan_parser, settings_from  # noqa: E402
from earl_lightning.planning.plan import make_plan, models_for, step_stats  # noqa: E402
from earl_lightning.planning.report import format_tables, summary, write_all  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CONFIG = Path(__file__).parent / "configs" / "qwen2.5-72b-instruct.json"
RECIPE = ROOT / "recipes" / "connect4_ppo.yaml"
CLUSTER = "16x8xH100-80G"
PAPER_DISPATCH = {
    8192: (46, 9.7),
    16384: (93, None),
    32768: (187, 11.2),
}  # MiB per worker, speed-up
MIB, GIB = 2**20, 2**30


def settings(num_seqs: int, contexts: str = "1024:32768", recipe: Path = RECIPE):
    argv = ["--model", str(CONFIG), "--cluster", CLUSTER, "--recipe", str(recipe)]
    argv += ["--contexts", contexts, "--dtype", "bfloat16", "--num-seqs", str(num_seqs)]
    return settings_from(plan_parser().parse_args(argv))


def plans() -> list[str]:
    out = []
    for n in (64, 512):
        result = make_plan(settings(n))
        write_all(result, RESULTS / f"plan_72b_{n}")
        out += [format_tables(result), ""]
        best = min(
            (r for r in summary(result) if r["policy"] != "adaptive"),
            key=lambda r: (-r["contexts_run"], r["total_seconds"]),
        )
        out.append(
            f"{n} sequences: the best static policy is {best['policy']} ({best['oom_contexts'] or 'no'} OOM)"
        )
    return out


def rollout_tp(num_seqs: int) -> list[dict]:
    """Rollout under dp32xtp4 and dp16xtp8 at every context: seconds, peak GiB, fits."""
    s = settings(num_seqs)
    memory, time = models_for(s)
    usable = 0.9 * s.cluster.device.memory_bytes
    rows = []
    for ctx in s.contexts:
        st = step_stats(s, ctx)
        row = {"num_seqs": num_seqs, "context": ctx}
        for tp in (4, 8):
            lay = Layout(128 // tp, tp, s.recipe.workload.micro_batch_tokens)
            peak = memory.estimate("rollout", lay, st, train_layout=Layout(128, 1)).total
            row[f"tp{tp}_s"] = time.seconds("rollout", lay, st)
            row[f"tp{tp}_gib"] = peak / GIB
            row[f"tp{tp}_fits"] = peak <= usable
        row["tp4_over_tp8"] = row["tp4_s"] / row["tp8_s"]
        rows.append(row)
    return rows


def responses_per_replica(context: int = 32768) -> list[dict]:
    """The most responses one rollout replica holds at ``context`` tokens, per TP and backend."""
    rows = []
    for backend in ("hf", "vllm"):
        s = settings(64, str(context))
        if backend == "vllm":
            work = dataclasses.replace(s.recipe.workload, backend="vllm")
            s = dataclasses.replace(s, recipe=dataclasses.replace(s.recipe, workload=work))
        memory, _ = models_for(s)
        usable = 0.9 * s.cluster.device.memory_bytes
        for tp in (4, 8):
            lay = Layout(128 // tp, tp, s.recipe.workload.micro_batch_tokens)
            most = 0
            while most < 4096:
                st = {**step_stats(s, context), "num_seqs": (most + 1) * lay.dp}
                if memory.estimate("rollout", lay, st, train_layout=Layout(128, 1)).total > usable:
                    break
                most += 1
            rows.append(
                {
                    "backend": backend,
                    "context": context,
                    "tp": tp,
                    "max_responses_per_replica": most,
                }
            )
    return rows


def dispatch() -> list[dict]:
    _, time = models_for(settings(64, "8192"))
    rows = []
    for ctx, (mib, paper) in PAPER_DISPATCH.items():
        for ranks in (16, 128):
            a2a = time.dispatch_seconds(mib * MIB, ranks)
            central = time.dispatch_seconds(mib * MIB, ranks, "centralized")
            rows.append(
                {
                    "context": ctx,
                    "mib_per_worker": mib,
                    "workers": ranks,
                    "all_to_all_s": a2a,
                    "centralized_s": central,
                    "model_speedup": central / a2a,
                    "paper_speedup": paper if paper is not None else "",
                }
            )
    return rows


def write(name: str, rows: list[dict]) -> None:
    with (RESULTS / name).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(
            {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(
        ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        + ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    )


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    print("\n".join(plans()))
    tp = rollout_tp(128) + rollout_tp(512)
    replicas, disp = responses_per_replica(), dispatch()
    write("plan_paper_rollout_tp.csv", tp)
    write("plan_paper_replicas.csv", replicas)
    write("plan_paper_dispatch.csv", disp)
    for title, rows in (
        ("rollout TP 4 vs TP 8", tp),
        ("responses per replica at 32K", replicas),
        ("dispatch", disp),
    ):
        print(f"\n{title}\n{markdown(rows)}")


if __name__ == "__main__":
    main()
