"""Adaptive layouts vs every static layout on a run whose context grows from ~0.5K to ~5.9K tokens.

A real RL run (AgenticRLModule, GRPO with 2 PPO epochs, EarlStrategy, 2 gloo processes) on the
``recall`` env, whose observations grow each phase (more turns, longer filler lines): 4 episodes
(2 GRPO groups) per step, ~0.5K tokens each in phase 1 and ~5.9K in phase 4. Every stage runs
under a per-rank memory budget.

The budget: a CPU process has no device memory limit, so each stage's memory is *measured*
(peak RSS of the stage over the RSS at its start: Linux ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, with glibc told to give every block of 256 KiB or more back to the OS
when freed, so that RSS follows live tensor memory) and a stage whose peak exceeds the budget on
any rank counts as failed. Static layouts record the failure and go on (so later phases are still
measured); under AdaptiveParallelism the over-budget stage raises ``MemoryError`` -- the same path
as a real allocation failure -- and the callback's OOM recovery retries it under the next layout.

Static layouts (every candidate AdaptiveParallelism chooses from): placement ``dp2xtp1`` or
``dp1xtp2`` for rollout and experience (the train stage keeps the optimizer's dp2xtp1 placement),
micro-batch budget 16384 tokens (one forward per rank) or 1024 (one sequence at a time), and
activation checkpointing of the train stage off or on. ``adaptive``: AdaptiveParallelism with a
profile measured first, in this script, at 256 / 1024 / 4096 tokens (not at the phases' lengths),
choosing all three knobs per stage and step.

Noise: both processes stay up for the whole benchmark (no start-up cost in any policy), every
policy runs in each round (order reversed every other round), and each figure is the median over
the phase's steps of all rounds; step 0 warms up and is not measured.

    python benchmarks/selector.py --quick         # 1 step per phase, 1 round, < 5 min
    python benchmarks/selector.py                 # 2 steps per phase, 3 rounds (~14 min)

Writes benchmarks/results/selector.csv (phase,context_mean,policy,stage,layout,tokens_per_s,failed),
selector_memory.csv (measured peaks, with the memory model's prediction where adaptive decided),
selector.png, the profile (selector_profile*.{json,png}) and prints the table and the targets'
verdicts.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_lightning.parallel.launch_env import free_port  # noqa: E402
from earl_lightning.parallel.layout import Layout  # noqa: E402
from earl_lightning.parallel.throughput import layout_key  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STAGES = ("rollout", "experience", "train")
MIB = 2**20


@dataclass(frozen=True)
class Phase:
    turns: int
    padding: int
    batch: int
    group: int = 2


PHASES = (Phase(4, 40, 4), Phase(6, 150, 4), Phase(8, 300, 4), Phase(8, 650, 4))
BIG, SMALL = (
    16384,
    1024,
)  # micro-batch token budgets: one forward per rank vs one sequence at a time
BUDGET_MIB = 130.0  # per rank and stage


# ---- measured memory ---------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def exact_rss_allocator() -> None:
    """Make RSS follow live tensor memory: every allocation of 256 KiB or more gets its own mmap,
    returned to the OS when freed (glibc's adaptive threshold would otherwise keep freed blocks
    and hide the next stage's peak)."""
    import ctypes

    # M_MMAP_THRESHOLD, fixed (disables the adaptation)
    ctypes.CDLL("libc.so.6").mallopt(-3, 256 * 1024)


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the RSS in bytes."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_since_reset() -> int:
    return _status_kib("VmHWM") * 1024


def make_budgeted_strategy(budget_bytes: int, enforce: bool, peaks: list):
    """EarlStrategy whose every stage's measured peak is checked against the budget."""
    import torch.distributed as dist

    from earl_lightning.strategies import EarlStrategy

    class BudgetedEarlStrategy(EarlStrategy):
        @contextmanager
        def stage(self, name, stats=None):
            with super().stage(name, stats) as ctx:
                layout = ctx.layout
                base = reset_peak()
                yield ctx
                used = torch.tensor([peak_since_reset() - base], dtype=torch.float64)
                dist.all_reduce(used, op=dist.ReduceOp.MAX)  # a stage fails if any rank runs out
                over = float(used) > budget_bytes
                peaks.append(
                    dict(stage=name, layout=layout_key(layout), peak=float(used), over=over)
                )
                if over and enforce:
                    raise MemoryError(
                        f"stage {name!r} under {layout.name} peaked at {float(used) / MIB:.0f} MiB "
                        f"> the {budget_bytes / MIB:.0f} MiB budget"
                    )

    return BudgetedEarlStrategy


# ---- the run ------------------------------------------------------------------------------------
def phase_of(step: int, steps_per_phase: int) -> int:
    """Step 0 warms the processes up (lazy initialization) on phase 1's workload and is not
    measured; phase p (0-based) then runs steps 1 + p * steps_per_phase ..."""
    return 0 if step == 0 else min((step - 1) // steps_per_phase, len(PHASES) - 1)


def make_datamodule(steps_per_phase: int):
    from earl_lightning.modules.datamodule import EpisodeDataModule, EpisodeStream

    class CurriculumStream(EpisodeStream):
        def batch(self, step):
            ph = PHASES[phase_of(step, steps_per_phase)]
            self.env_kwargs = {"num_turns": ph.turns, "padding_chars": ph.padding, "lag": 1}
            self.batch_size, self.group_size = ph.batch, ph.group
            return super().batch(step)

    class CurriculumData(EpisodeDataModule):
        def train_dataloader(self):
            from torch.utils.data import DataLoader

            from earl_lightning.modules.datamodule import _identity

            stream = CurriculumStream(
                self.env, self.env_kwargs, self.batch_size, self.group_size, self.seed, 0
            )
            return DataLoader(stream, batch_size=1, collate_fn=_identity, num_workers=0)

    first = PHASES[0]
    return CurriculumData(
        env="recall",
        env_kwargs={"num_turns": first.turns, "padding_chars": first.padding},
        batch_size=first.batch,
        group_size=first.group,
        eval_episodes=0,
    )


def make_module():
    from earl_lightning.modules import AgenticRLModule

    return AgenticRLModule(
        model="earl-tiny",
        rollout=dict(max_turns=8, max_context_tokens=7168, sampling=dict(max_new_tokens=1)),
        optim=dict(micro_batch_tokens=BIG, lr=1e-4, ppo_epochs=2),
        transcripts={"every_n_steps": 0},
        seed=0,
    )


def parse_policy(policy: str) -> Layout:
    """``dp2xtp1-mbt1024-ckpt`` -> its Layout (checkpointing applies to the train stage only)."""
    m = re.fullmatch(r"dp(\d+)xtp(\d+)-mbt(\d+)(-ckpt)?", policy)
    if m is None:
        raise ValueError(
            f"unknown policy {policy!r}; valid: 'adaptive' or like 'dp2xtp1-mbt1024-ckpt'"
        )
    return Layout(int(m[1]), int(m[2]), int(m[3]), bool(m[4]))


def static_policies() -> list[str]:
    return [
        layout_key(Layout(d, t, m, c))
        for d, t in ((2, 1), (1, 2))
        for m in (BIG, SMALL)
        for c in (False, True)
    ]


def policy_strategy(policy: str, budget: int, peaks: list):
    cls = make_budgeted_strategy(budget, enforce=policy == "adaptive", peaks=peaks)
    if policy == "adaptive":
        return cls(layouts="auto")
    lay = parse_policy(policy)
    # The optimizer's copy stays dp2xtp1 (FSDP over both ranks); the policy's placement serves
    # rollout and experience, its micro-batch budget every stage, its checkpointing the train stage.
    train = Layout(2, 1, lay.micro_batch_tokens, lay.activation_checkpointing)
    return cls(train_layout=train, layouts={"rollout": lay, "experience": lay, "train": train})


def fit_once(rank, world, port, policy, budget, steps_per_phase, profile) -> dict:
    import gc

    import lightning as L

    from earl_lightning.callbacks import AdaptiveParallelism

    # Lightning's teardown removes some of these; every fit joins the same process group again.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        TOKENIZERS_PARALLELISM="false",
    )
    peaks, steps = [], []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            m = {k: float(v) for k, v in trainer.callback_metrics.items()}
            steps.append(dict(step=trainer.global_step - 1, metrics=m, peaks=list(peaks)))
            peaks.clear()

    callbacks = [Record()]
    adaptive = None
    if policy == "adaptive":
        adaptive = AdaptiveParallelism(
            profile=profile,
            memory_budget_bytes=budget,
            micro_batch_tokens=[BIG, SMALL],
            activation_checkpointing=[False, True],
        )
        callbacks.insert(0, adaptive)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=policy_strategy(policy, budget, peaks),
        callbacks=callbacks,
        max_steps=1 + steps_per_phase * len(PHASES),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
        default_root_dir=f"/tmp/earl_sel_{policy}",
    )
    trainer.fit(make_module(), make_datamodule(steps_per_phase))
    out = dict(
        steps=steps,
        history=list(adaptive.history) if adaptive else [],
        ooms=adaptive.oom_events if adaptive else [],
    )
    del trainer
    gc.collect()
    return out


def bench_worker(
    rank,
    world,
    port,
    policies,
    rounds,
    budget,
    steps_per_phase,
    profile,
    do_profile,
    repeats,
    queue,
):
    """One pair of processes for everything: the profile, then every policy in every round
    (alternating order: A B C ... C B A ...), so that slow drifts of a shared machine hit all
    policies alike and no policy pays for process start-up."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        TOKENIZERS_PARALLELISM="false",
    )
    torch.set_num_threads(1)
    # the module must not undo exact_rss_allocator (host_memory.py)
    os.environ["EARL_HOST_MEMORY"] = "glibc"
    exact_rss_allocator()
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if do_profile:
            run_profile(rank, profile, repeats)
            dist.barrier()
        results: dict[str, list] = {p: [] for p in policies}
        for r in range(rounds):
            for pol in policies if r % 2 == 0 else policies[::-1]:
                t = time.perf_counter()
                results[pol].append(
                    fit_once(rank, world, port, pol, budget, steps_per_phase, profile)
                )
                if rank == 0:
                    print(
                        f"round {r + 1}/{rounds} {pol}: {time.perf_counter() - t:.0f}s", flush=True
                    )
        queue.put((rank, results))
    except BaseException:  # noqa: BLE001 - surface the failure to the parent
        import traceback

        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_profile(rank, out, repeats):
    from earl_lightning.models import load_model, load_tokenizer
    from earl_lightning.profiling.profiler import ProfileGrid, profile_stages

    placements = [Layout(d, t, m) for d, t in ((2, 1), (1, 2)) for m in (BIG, SMALL)]
    layouts = placements + [
        Layout(2, 1, m, True) for m in (BIG, SMALL)
    ]  # checkpointing: train stage only
    grid = ProfileGrid(contexts=[256, 1024, 4096], num_seqs=[4], gen_len=1, repeats=repeats)
    t = time.perf_counter()
    run = profile_stages(
        lambda: load_model("earl-tiny"),
        load_tokenizer("earl-tiny"),
        layouts=layouts,
        grid=grid,
        model_name="earl-tiny",
        log=print,
    )
    if rank == 0:
        run.table.save(out)
        run.table.heatmaps(Path(out).parent, prefix="selector_profile")
        print(
            f"profiled {run.measured} cells in {time.perf_counter() - t:.0f}s -> {out}", flush=True
        )


def spawn(target, world: int, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    for r in range(world):
        if isinstance(results[r], str):
            raise RuntimeError(f"rank {r} failed:\n{results[r]}")
    return results[0]


# ---- aggregation and report ---------------------------------------------------------------------
def phase_rows(
    policy: str, rounds: list[dict], steps_per_phase: int
) -> tuple[list[dict], list[dict]]:
    """One row per (phase, stage) and one ``step`` row (all tokens / all stage seconds), each the
    median over the phase's steps of every round; the warm-up step 0 is left out."""
    rows, mem = [], []
    predicted = [
        {(h["step"], h["stage"], h["layout"]): h["predicted_bytes"] for h in res["history"]}
        for res in rounds
    ]  # the memory model's estimate of every adaptive decision
    for p in range(len(PHASES)):
        steps = [
            dict(s, predicted=pred)
            for res, pred in zip(rounds, predicted)
            for s in res["steps"]
            if s["step"] > 0 and phase_of(s["step"], steps_per_phase) == p
        ]
        ctx = statistics.mean(s["metrics"].get("context/mean", 0.0) for s in steps)
        failed_any = False
        for stage in STAGES:
            tps = statistics.median(s["metrics"][f"stage/{stage}/tokens_per_s"] for s in steps)
            finals, failed = [], False
            for s in steps:
                recs = [r for r in s["peaks"] if r["stage"] == stage]
                # static: any over-budget run failed; adaptive: the last attempt (after recoveries) counts
                failed |= (
                    any(r["over"] for r in recs)
                    if policy != "adaptive"
                    else bool(recs and recs[-1]["over"])
                )
                finals.append(recs[-1]["layout"] if recs else "?")
                mem += [
                    dict(
                        phase=p + 1,
                        policy=policy,
                        stage=stage,
                        layout=r["layout"],
                        peak_mib=r["peak"] / MIB,
                        predicted_mib=s["predicted"].get((s["step"], stage, r["layout"]), math.nan)
                        / MIB,
                        over_budget=r["over"],
                    )
                    for r in recs
                ]
            failed_any |= failed
            rows.append(
                dict(
                    phase=p + 1,
                    context_mean=round(ctx),
                    policy=policy,
                    stage=stage,
                    layout="+".join(dict.fromkeys(finals)),
                    tokens_per_s=round(tps, 1),
                    failed=failed,
                )
            )
        per_step = []
        for s in steps:
            m = s["metrics"]
            secs = sum(m[f"stage/{st}/seconds"] for st in STAGES)
            per_step.append(
                m["stage/experience/tokens_per_s"] * m["stage/experience/seconds"] / max(secs, 1e-9)
            )
        rows.append(
            dict(
                phase=p + 1,
                context_mean=round(ctx),
                policy=policy,
                stage="step",
                layout=rows[-1]["layout"],
                tokens_per_s=round(statistics.median(per_step), 1),
                failed=failed_any,
            )
        )
    return rows, mem


def verdicts(rows: list[dict]) -> list[str]:
    step = [r for r in rows if r["stage"] == "step"]
    statics = sorted({r["policy"] for r in step} - {"adaptive"})
    out, ok_all = [], True
    if not any(r["policy"] == "adaptive" for r in step):
        return ["no adaptive run: targets not evaluated"]
    for p in sorted({r["phase"] for r in step}):
        a = next(r for r in step if r["phase"] == p and r["policy"] == "adaptive")
        ok = [r for r in step if r["phase"] == p and r["policy"] != "adaptive" and not r["failed"]]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
        ratio = a["tokens_per_s"] / best["tokens_per_s"] if best else float("inf")
        good = not a["failed"] and ratio >= 0.95
        ok_all &= good
        out.append(
            f"phase {p}: adaptive {'FAILED' if a['failed'] else 'ok'}, {a['tokens_per_s']:.0f} tok/s = "
            f"{ratio:.0%} of the best static that did not fail ({best['policy'] if best else 'none'}) "
            f"-> {'met' if good else 'NOT met'}"
        )
    for pol in statics:
        mine = [r for r in step if r["policy"] == pol]
        fails = [r["phase"] for r in mine if r["failed"]]
        slower = [
            r["phase"]
            for r in mine
            if not r["failed"]
            and r["tokens_per_s"]
            <= 0.85
            * next(
                a["tokens_per_s"]
                for a in step
                if a["policy"] == "adaptive" and a["phase"] == r["phase"]
            )
        ]
        good = bool(fails or slower)
        ok_all &= good
        out.append(
            f"static {pol}: fails in phases {fails or '-'}, >=15% slower than adaptive in phases "
            f"{slower or '-'} -> {'met' if good else 'NOT met'}"
        )
    out.append("ALL TARGETS MET" if ok_all else "SOME TARGETS NOT MET (see above)")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = [r for r in rows if r["stage"] == "step"]
    policies = list(dict.fromkeys(r["policy"] for r in step))
    phases = sorted({r["phase"] for r in step})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(policies)
    for i, pol in enumerate(policies):
        for j, p in enumerate(phases):
            r = next(x for x in step if x["policy"] == pol and x["phase"] == p)
            bar = ax.bar(
                j + i * width,
                r["tokens_per_s"],
                width,
                color=f"C{i}",
                label=pol if j == 0 else None,
                hatch="xx" if r["failed"] else None,
                alpha=0.4 if r["failed"] else 1.0,
            )
            if r["failed"]:
                ax.text(
                    bar[0].get_x() + width / 2,
                    r["tokens_per_s"],
                    "over\nbudget",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    ctx = {p: next(r["context_mean"] for r in step if r["phase"] == p) for p in phases}
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(phases))],
        [f"phase {p}\n~{ctx[p]} tokens" for p in phases],
    )
    ax.set_ylabel("step tokens/s (all stages)")
    ax.set_title(
        "AdaptiveParallelism vs static layouts, 2 gloo processes, per-rank memory budget",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="1 step per phase, 1 round, profile once (under 5 minutes)",
    )
    ap.add_argument("--steps-per-phase", type=int, default=None)
    ap.add_argument(
        "--rounds", type=int, default=None, help="passes over all policies, alternating order"
    )
    ap.add_argument(
        "--budget-mib", type=float, default=BUDGET_MIB, help="per-rank memory budget of one stage"
    )
    ap.add_argument("--policies", nargs="+", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--reuse-profile", action="store_true", help="use the profile already in --out")
    args = ap.parse_args(argv)
    steps = args.steps_per_phase or (1 if args.quick else 2)
    rounds = args.rounds or (1 if args.quick else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = int(args.budget_mib * MIB)
    policies = args.policies or static_policies() + ["adaptive"]
    for pol in policies:
        if pol != "adaptive":
            parse_policy(pol)
    t0 = time.perf_counter()
    profile = str(out / "selector_profile.json")
    do_profile = not (args.reuse_profile and Path(profile).is_file())
    results = spawn(
        bench_worker,
        2,
        policies,
        rounds,
        budget,
        steps,
        profile,
        do_profile,
        1 if args.quick else 3,
    )
    rows, mem = [], []
    for pol in policies:
        r, m = phase_rows(pol, results[pol], steps)
        rows += r
        mem += m
        ooms = [(o["stage"], o["layout"]) for res in results[pol] for o in res["ooms"]]
        if ooms:
            print(f"{pol}: OOM recoveries {ooms}")
    write_csv(out / "selector.csv", rows)
    write_csv(out / "selector_memory.csv", mem)
    plot(rows, out / "selector.png")
    print(
        f"\n{'phase':>5} {'ctx':>5} {'policy':24s} {'stage':10s} {'layout':44s} {'tok/s':>9} failed"
    )
    for r in rows:
        print(
            f"{r['phase']:>5} {r['context_mean']:>5} {r['policy']:24s} {r['stage']:10s} {r['layout']:44s} "
            f"{r['tokens_per_s']:>9.0f} {'FAILED' if r['failed'] else ''}"
        )
    print(
        f"\nbudget {args.budget_mib:.0f} MiB per rank and stage; {steps} step(s) per phase, {rounds} round(s); "
        f"total {time.perf_counter() - t0:.0f}s"
    )
    print("\n".join(verdicts(rows)))


if __name__ == "__main__":
    main()
