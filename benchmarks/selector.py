"""Adaptive layouts vs every static layout on a run whose context grows from ~0.5K to ~4.8K tokens.

A real RL run (AgenticRLModule, GRPO, EarlStrategy, 2 gloo processes) on the ``recall`` env, whose
observations grow each phase (more turns, longer filler lines): 4 episodes (2 GRPO groups) per
step, ~0.4K tokens each in phase 1 and ~4.8K in phase 4. Every stage runs under a per-rank memory
budget.

The budget: a CPU process has no device memory limit, so each stage's memory is *measured*
(peak RSS of the stage over the RSS at its start: Linux ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, with glibc told to give every block of 256 KiB or more back to the OS
when freed, so that RSS follows live tensor memory) and a stage whose peak exceeds the budget on
any rank counts as failed.
Static layouts record the failure and go on (so later phases are still measured); under
AdaptiveParallelism the over-budget stage raises ``MemoryError`` -- the same path as a real
allocation failure -- and the callback's OOM recovery retries it under the next layout.

Policies: static ``dp2xtp1`` and ``dp1xtp2`` (rollout and experience placements; the train
stage always keeps the optimizer's dp2xtp1 placement), each with a 16384-token micro-batch budget
(one forward per rank) and a 1024-token one (about one sequence per forward), and ``adaptive``
(AdaptiveParallelism with a profile measured first, in this script, at 256 / 1024 / 4096 tokens --
not at the phases' own lengths).

    python benchmarks/selector.py --quick         # 2 processes, 2 steps per phase, < 5 min
    python benchmarks/selector.py                 # 3 steps per phase

Writes benchmarks/results/selector.csv (phase,context_mean,policy,stage,layout,tokens_per_s,failed),
selector_memory.csv (measured peaks), selector.png, the profile (selector_profile*.{json,png}) and
prints the table and the targets' verdicts.
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results"
STAGES = ("rollout", "experience", "train")
MIB = 2**20


@dataclass(frozen=True)
class Phase:
    turns: int
    padding: int
    batch: int
    group: int = 2


PHASES = (Phase(4, 40, 4), Phase(6, 150, 4), Phase(8, 230, 4), Phase(8, 520, 4))
BIG, SMALL = 16384, 1024  # micro-batch token budgets: one forward per rank vs one sequence at a time


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

    ctypes.CDLL("libc.so.6").mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD, fixed (disables the adaptation)


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
            with super().stage(name, stats) as layout:
                base = reset_peak()
                yield layout
                used = torch.tensor([peak_since_reset() - base], dtype=torch.float64)
                dist.all_reduce(used, op=dist.ReduceOp.MAX)  # a stage fails if any rank runs out
                over = float(used) > budget_bytes
                peaks.append(dict(stage=name, layout=f"{layout.name}-mbt{layout.micro_batch_tokens}",
                                  peak=float(used), over=over))
                if over and enforce:
                    raise MemoryError(f"stage {name!r} under {layout.name} peaked at {float(used) / MIB:.0f} MiB "
                                      f"> the {budget_bytes / MIB:.0f} MiB budget")

    return BudgetedEarlStrategy


# ---- the run ------------------------------------------------------------------------------------
def make_datamodule(steps_per_phase: int):
    from earl_lightning.data.datamodule import EpisodeDataModule, EpisodeStream

    class CurriculumStream(EpisodeStream):
        def batch(self, step):
            ph = PHASES[min(step // steps_per_phase, len(PHASES) - 1)]
            self.env_kwargs = {"num_turns": ph.turns, "padding_chars": ph.padding, "lag": 1}
            self.batch_size, self.group_size = ph.batch, ph.group
            return super().batch(step)

    class CurriculumData(EpisodeDataModule):
        def train_dataloader(self):
            from torch.utils.data import DataLoader

            from earl_lightning.data.datamodule import _identity

            stream = CurriculumStream(self.env, self.env_kwargs, self.batch_size, self.group_size, self.seed, 0)
            return DataLoader(stream, batch_size=1, collate_fn=_identity, num_workers=0)

    first = PHASES[0]
    return CurriculumData(env="recall", env_kwargs={"num_turns": first.turns, "padding_chars": first.padding},
                          batch_size=first.batch, group_size=first.group, eval_episodes=0)


def make_module():
    from earl_lightning.modules import AgenticRLModule

    return AgenticRLModule(model="earl-tiny", max_turns=8, max_new_tokens=1, max_context_tokens=6144,
                           micro_batch_tokens=BIG, lr=1e-4, transcript_every_n_steps=0, seed=0)


def policy_strategy(policy: str, budget: int, peaks: list):
    from earl_lightning.parallel.layout import Layout

    cls = make_budgeted_strategy(budget, enforce=policy == "adaptive", peaks=peaks)
    if policy == "adaptive":
        return cls(layouts="auto")
    place, mbt = policy.split("-mbt")
    dp, tp = (int(x) for x in place[2:].split("xtp"))
    lay = {"dp": dp, "tp": tp, "micro_batch_tokens": int(mbt)}
    train = {**Layout(2, 1).__dict__, "micro_batch_tokens": int(mbt)}
    return cls(train_layout={"dp": 2, "tp": 1}, layouts={"rollout": lay, "experience": lay, "train": train})


def fit_worker(rank, world, port, policy, budget, steps_per_phase, profile, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    exact_rss_allocator()
    import warnings

    import lightning as L
    import torch.distributed as dist

    from earl_lightning.callbacks import AdaptiveParallelism

    warnings.filterwarnings("ignore")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        peaks, steps = [], []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                m = {k: float(v) for k, v in trainer.callback_metrics.items()}
                steps.append(dict(step=trainer.global_step - 1, metrics=m, peaks=list(peaks)))
                peaks.clear()

        callbacks = [Record()]
        adaptive = None
        if policy == "adaptive":
            adaptive = AdaptiveParallelism(profile=profile, memory_budget_bytes=budget,
                                           micro_batch_tokens=[BIG, SMALL])
            callbacks.insert(0, adaptive)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=policy_strategy(policy, budget, peaks),
                            callbacks=callbacks, max_steps=steps_per_phase * len(PHASES), logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, log_every_n_steps=1, default_root_dir=f"/tmp/earl_sel_{policy}")
        trainer.fit(make_module(), make_datamodule(steps_per_phase))
        queue.put((rank, dict(steps=steps, history=adaptive.history if adaptive else [],
                              ooms=adaptive.oom_events if adaptive else [])))
    except BaseException as e:  # noqa: BLE001 - surface the failure to the parent
        import traceback

        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def profile_worker(rank, world, port, out, repeats, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from earl_lightning.models import load_model, load_tokenizer
    from earl_lightning.parallel.layout import Layout
    from earl_lightning.parallel.profiler import ProfileGrid, profile_stages

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        layouts = [Layout(2, 1, BIG), Layout(1, 2, BIG), Layout(2, 1, SMALL), Layout(1, 2, SMALL)]
        grid = ProfileGrid(contexts=[256, 1024, 4096], num_seqs=[4], gen_len=1, repeats=repeats)
        run = profile_stages(lambda: load_model("earl-tiny"), load_tokenizer("earl-tiny"), layouts=layouts,
                             grid=grid, model_name="earl-tiny", log=print)
        if rank == 0:
            run.table.save(out)
            run.table.heatmaps(Path(out).parent, prefix="selector_profile")
        queue.put((rank, run.seconds))
    except BaseException:  # noqa: BLE001
        import traceback

        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(target, world: int, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if isinstance(results[0], str):
        raise RuntimeError(f"worker failed:\n{results[0]}")
    return results[0]


# ---- aggregation and report ---------------------------------------------------------------------
def phase_rows(policy: str, result: dict, steps_per_phase: int) -> tuple[list[dict], list[dict]]:
    """One row per (phase, stage) and one ``step`` row (all tokens / all stage seconds); step 0
    (lazy initialization of the processes) is left out."""
    rows, mem = [], []
    for p in range(len(PHASES)):
        steps = [s for s in result["steps"] if s["step"] // steps_per_phase == p and s["step"] > 0]
        ctx = statistics.mean(s["metrics"].get("context/mean", 0.0) for s in steps)
        secs_total, tokens = 0.0, 0.0
        failed_any = False
        for stage in STAGES:
            tps = statistics.mean(s["metrics"][f"stage/{stage}/tokens_per_s"] for s in steps)
            secs = statistics.mean(s["metrics"][f"stage/{stage}/seconds"] for s in steps)
            secs_total += secs
            if stage == "experience":
                tokens = tps * secs
            finals, failed = [], False
            for s in steps:
                recs = [r for r in s["peaks"] if r["stage"] == stage]
                # static: any over-budget run failed; adaptive: the last attempt (after recoveries) counts
                failed |= any(r["over"] for r in recs) if policy != "adaptive" else bool(recs and recs[-1]["over"])
                finals.append(recs[-1]["layout"] if recs else "?")
                mem += [dict(phase=p + 1, policy=policy, stage=stage, layout=r["layout"], peak_mib=r["peak"] / MIB,
                             over_budget=r["over"]) for r in recs]
            failed_any |= failed
            rows.append(dict(phase=p + 1, context_mean=round(ctx), policy=policy, stage=stage,
                             layout="+".join(dict.fromkeys(finals)), tokens_per_s=round(tps, 1), failed=failed))
        rows.append(dict(phase=p + 1, context_mean=round(ctx), policy=policy, stage="step",
                         layout=rows[-2]["layout"], tokens_per_s=round(tokens / max(secs_total, 1e-9), 1),
                         failed=failed_any))
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
        out.append(f"phase {p}: adaptive {'FAILED' if a['failed'] else 'ok'}, {a['tokens_per_s']:.0f} tok/s = "
                   f"{ratio:.0%} of the best static that did not fail ({best['policy'] if best else 'none'}) "
                   f"-> {'met' if good else 'NOT met'}")
    for pol in statics:
        mine = [r for r in step if r["policy"] == pol]
        fails = [r["phase"] for r in mine if r["failed"]]
        slower = [r["phase"] for r in mine if not r["failed"] and r["tokens_per_s"] <= 0.85 * next(
            a["tokens_per_s"] for a in step if a["policy"] == "adaptive" and a["phase"] == r["phase"])]
        good = bool(fails or slower)
        ok_all &= good
        out.append(f"static {pol}: fails in phases {fails or '-'}, >=15% slower than adaptive in phases "
                   f"{slower or '-'} -> {'met' if good else 'NOT met'}")
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
            bar = ax.bar(j + i * width, r["tokens_per_s"], width, color=f"C{i}", label=pol if j == 0 else None,
                         hatch="xx" if r["failed"] else None, alpha=0.4 if r["failed"] else 1.0)
            if r["failed"]:
                ax.text(bar[0].get_x() + width / 2, r["tokens_per_s"], "over\nbudget", ha="center", va="bottom",
                        fontsize=6)
    ctx = {p: next(r["context_mean"] for r in step if r["phase"] == p) for p in phases}
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))],
                  [f"phase {p}\n~{ctx[p]} tokens" for p in phases])
    ax.set_ylabel("step tokens/s (all stages)")
    ax.set_title("AdaptiveParallelism vs static layouts, 2 gloo processes, per-rank memory budget", fontsize=9)
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
    ap.add_argument("--quick", action="store_true", help="2 steps per phase (under 5 minutes)")
    ap.add_argument("--steps-per-phase", type=int, default=None)
    ap.add_argument("--budget-mib", type=float, default=160.0, help="per-rank memory budget of one stage")
    ap.add_argument("--policies", nargs="+", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--reuse-profile", action="store_true", help="use the profile already in --out")
    args = ap.parse_args(argv)
    steps = args.steps_per_phase or (2 if args.quick else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = int(args.budget_mib * MIB)
    t0 = time.perf_counter()
    profile = str(out / "selector_profile.json")
    if not (args.reuse_profile and Path(profile).is_file()):
        spawn(profile_worker, 2, profile, 1 if args.quick else 3)
    print(f"profiled in {time.perf_counter() - t0:.0f}s -> {profile}")
    statics = [f"dp{d}xtp{t}-mbt{m}" for d, t in ((2, 1), (1, 2)) for m in (BIG, SMALL)]
    policies = args.policies or statics + ["adaptive"]
    rows, mem = [], []
    for pol in policies:
        t = time.perf_counter()
        try:
            res = spawn(fit_worker, 2, pol, budget, steps, profile)
        except RuntimeError as err:  # the whole run failed (e.g. no layout fits): every phase failed
            print(f"{pol}: run failed: {str(err).strip().splitlines()[-1]}")
            rows += [dict(phase=p + 1, context_mean=0, policy=pol, stage=st, layout="-", tokens_per_s=0.0,
                          failed=True) for p in range(len(PHASES)) for st in (*STAGES, "step")]
            continue
        r, m = phase_rows(pol, res, steps)
        rows += r
        mem += m
        ooms = [(o["stage"], o["layout"]) for o in res["ooms"]]
        print(f"{pol}: {time.perf_counter() - t:.0f}s" + (f"; OOM recoveries {ooms}" if ooms else ""))
    write_csv(out / "selector.csv", rows)
    write_csv(out / "selector_memory.csv", mem)
    plot(rows, out / "selector.png")
    print(f"\n{'phase':>5} {'ctx':>5} {'policy':18s} {'stage':10s} {'layout':36s} {'tok/s':>9} failed")
    for r in rows:
        print(f"{r['phase']:>5} {r['context_mean']:>5} {r['policy']:18s} {r['stage']:10s} {r['layout']:36s} "
              f"{r['tokens_per_s']:>9.0f} {'FAILED' if r['failed'] else ''}")
    print("\nbudget {:.0f} MiB per rank and stage; total {:.0f}s".format(args.budget_mib, time.perf_counter() - t0))
    print("\n".join(verdicts(rows)))


if __name__ == "__main__":
    main()
