"""Three costs of an RL step that do not scale with the model, measured side by side (issue 54's
search for the lost margin over TRL):

1. **Environment calls**: a rollout's 64 resets and 64 steps of a trivial environment (the
   vs-TRL single-turn task), through :class:`~earl_lightning.rollout.env_calls.EnvCalls` with its
   default time limit: on the rollout's own thread (where calls that only compute now run), and on
   the worker threads (where every call ran before; a rollout started off the main thread still
   runs its calls there).
2. **Step metrics**: the ~31 scalars an RL step logs, through Lightning's ``self.log_dict`` and
   through the loggers directly (``logger.log_metrics``), in a Lightning fit whose step does
   nothing else.
3. **Chat-template renders**: the two renders per episode and turn of a multi-turn rollout (64
   episodes × 10 turns, the conversation growing), with the earl-tiny template as it is and as it
   was (finding tool calls with ``message.get(...)``, a call the Jinja sandbox checks each time).

The sides alternate, each repeated; the table gives the medians, their ratio and the load::

    python benchmarks/step_overheads.py             # ~1 min
    python benchmarks/step_overheads.py --repeats 9

It writes ``benchmarks/results/step_overheads.csv``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EPISODES = 64
METRICS = 31
TURNS = 10
# the earl-tiny template's tool-call loop as it was until issue 54 (a sandboxed method call per message)
TOOL_CALLS_NOW = "{%- if 'tool_calls' in message -%}{%- for call in message['tool_calls'] or [] -%}"
TOOL_CALLS_BEFORE = "{%- for call in message.get('tool_calls') or [] -%}"


def env_calls_ms(where: str, rollouts: int) -> tuple[float, float]:
    """Wall and CPU milliseconds per rollout of a trivial env's resets and steps, ``where`` the
    calls run: ``here`` (this, the main thread) or ``threads`` (the workers)."""
    from earl_lightning.rollout.env_calls import EnvCalls
    from earl_lightning.rollout.types import EpisodeSpec

    specs = [
        EpisodeSpec("benchmarks.vs_trl_env.PromptTask", i, i // 8, i, {"completion_len": 8})
        for i in range(EPISODES)
    ]

    def one() -> None:
        calls = EnvCalls(timeout_s=120.0)
        started = calls.start_all(specs)
        calls.step_all([(s, env, "1234abcd") for s, (env, _) in zip(specs, started)])
        calls.close()

    def timed(out: list) -> None:
        one()  # warm: imports, the first pool threads
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(rollouts):
            one()
        out += [(time.perf_counter() - t0) / rollouts, (time.process_time() - c0) / rollouts]

    out: list[float] = []
    if where == "here":
        timed(out)
    else:  # off the main thread a limited call cannot be interrupted: every call on a worker
        runner = threading.Thread(target=timed, args=(out,))
        runner.start()
        runner.join()
    return out[0] * 1e3, out[1] * 1e3


def logging_ms(how: str, steps: int) -> tuple[float, float]:
    """Wall milliseconds per step spent logging :data:`METRICS` scalars (median over steps), and
    the fit's wall milliseconds per step; ``how``: ``log_dict`` or ``loggers``."""
    import lightning as L
    import torch

    class Logs(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.p = torch.nn.Parameter(torch.zeros(1))
            self.spent: list[float] = []

        def training_step(self, batch, batch_idx):
            t0 = time.perf_counter()
            values = {f"group{k % 6}/metric{k}": float(k + batch_idx) for k in range(METRICS)}
            if how == "log_dict":
                self.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
            else:
                for lg in self.loggers:
                    lg.log_metrics(values, step=self.global_step)
            self.spent.append(time.perf_counter() - t0)
            self.optimizers().step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(steps + 10)), batch_size=1)

    module = Logs()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            max_steps=steps,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=root,
            log_every_n_steps=1,
        )
        t0 = time.perf_counter()
        trainer.fit(module)
        wall = (time.perf_counter() - t0) / steps
    return statistics.median(module.spent[10:]) * 1e3, wall * 1e3


def renders_ms(side: str, rollouts: int) -> tuple[float, float]:
    """Wall and CPU milliseconds per rollout's chat renders (two per episode and turn), with the
    template ``now`` or ``before``."""
    from earl_lightning.models import load_tokenizer
    from earl_lightning.rollout.chat import ChatDeltas

    tok = load_tokenizer("earl-tiny")
    if side == "before":
        template = tok.chat_template.replace(TOOL_CALLS_NOW, TOOL_CALLS_BEFORE)
        closed = "{%- endfor -%}{%- endif -%}{{ '<|im_end|>\n' }}"
        tok.chat_template = template.replace(closed, "{%- endfor -%}{{ '<|im_end|>\n' }}")
        assert tok.chat_template.count("{%- endif -%}") + 1 == template.count("{%- endif -%}")
    wall = cpu = 0.0
    for _ in range(rollouts):
        chat = ChatDeltas(tok)  # one per rollout, as the loop makes them (its memo starts empty)
        start, start_cpu = time.perf_counter(), time.process_time()
        for e in range(EPISODES):
            messages = [{"role": "user", "content": f"Write digits ({e})."}]
            for t in range(TURNS):
                chat.end_of_turn(messages, "12345678")
                messages.append({"role": "assistant", "content": "12345678"})
                chat.next_user(messages, f"8 digits. Turn {t + 2}/{TURNS}: more digits.")
                messages.append({"role": "user", "content": f"8 digits. Turn {t + 2}/{TURNS}."})
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
    return wall / rollouts * 1e3, cpu / rollouts * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=30, help="rollouts per env-call measurement")
    p.add_argument("--steps", type=int, default=100, help="steps per logging measurement")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    for name in ("repeats", "rollouts", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"step_overheads: error: --{name} must be >= 1")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    rows = []
    for r in range(args.repeats):
        sides = [("env calls", "threads"), ("env calls", "here")]
        sides += [("step metrics", "log_dict"), ("step metrics", "loggers")]
        sides += [("chat renders", "before"), ("chat renders", "now")]
        if r % 2:  # each pair in the other order
            sides = [side for i in range(0, len(sides), 2) for side in sides[i : i + 2][::-1]]
        for what, side in sides:
            load = os.getloadavg()[0]
            if what == "env calls":
                wall, other = env_calls_ms(side, args.rollouts)
            elif what == "chat renders":
                wall, other = renders_ms(side, max(1, args.rollouts // 10))
            else:
                wall, other = logging_ms(side, args.steps)
            rows.append(
                {
                    "what": what,
                    "side": side,
                    "repeat": r,
                    "ms": wall,
                    "other_ms": other,
                    "load": load,
                }
            )
            print(f"{what:12} {side:8} {wall:8.3f} ms ({other:.3f}) load {load:.1f}", flush=True)
    write(rows, args.out)


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "step_overheads.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    med = {}
    for r in rows:
        med.setdefault((r["what"], r["side"]), []).append(r)
    print("\n| cost | before | ms | after | ms | before / after | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for what, before, after, unit in (
        ("env calls", "threads", "here", f"wall per rollout of {EPISODES} resets + steps"),
        ("step metrics", "log_dict", "loggers", f"per step, {METRICS} scalars"),
        ("chat renders", "before", "now", f"per rollout, {EPISODES} episodes × {TURNS} turns"),
    ):
        a = statistics.median(r["ms"] for r in med[(what, before)])
        b = statistics.median(r["ms"] for r in med[(what, after)])
        load = statistics.median(r["load"] for r in med[(what, before)] + med[(what, after)])
        print(
            f"| {what} ({unit}) | {before} | {a:.3f} | {after} | {b:.3f} | {a / b:.1f}× | {load:.1f} |"
        )


if __name__ == "__main__":
    main()
