"""The memory model against measured peaks: the project's real train step (padded micro-batch
forward of ``train/forward``, backward, AdamW step) and real rollout (the HF generation
backend, one call or several turns over its kept KV cache; a multi-turn rollout is sized as the
selector sizes it, by the final sequences' ``context_stats``) on the tiny model and the
~100M-parameter preset, each group in a fresh subprocess.

On CPU the peak is the rise of the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``)
over the RSS before the stage, after one warm-up pass of every stage (a running trainer has its
code pages faulted in already). ``MALLOC_MMAP_THRESHOLD_`` is pinned so that freed tensors go back
to the OS at once and RSS follows live memory, as a device allocator's peak does. On GPU the
peak is ``torch.cuda.max_memory_allocated``. Run with ``-s`` to see the table.

This file is also the worker: ``python tests/unit/test_memory_model_measured.py '<json specs>'``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

TOLERANCE = 0.30
TINY = "earl-tiny"
M100 = "earl-tiny-100m"
# logits dominate
WIDE_VOCAB = dict(vocab=8192, overrides=dict(hidden_size=64, intermediate_size=128))

SPECS = {
    "tiny": [
        dict(name="tiny train 8x256", preset=TINY, stage="train", num_seqs=8, context=256),
        dict(
            name="tiny train 8x256 ckpt",
            preset=TINY,
            stage="train",
            num_seqs=8,
            context=256,
            ckpt=True,
        ),
        dict(
            name="tiny rollout 32x512+32",
            preset=TINY,
            stage="rollout",
            num_seqs=32,
            context=512,
            gen_len=32,
        ),
        dict(
            name="tiny rollout 8x1024+16",
            preset=TINY,
            stage="rollout",
            num_seqs=8,
            context=1024,
            gen_len=16,
        ),
        # multi-turn: the KV cache kept between turns, each turn encoding its observation only
        dict(
            name="tiny 10 turns 64x(80+8+56)",
            preset=TINY,
            stage="rollout",
            num_seqs=64,
            context=80,
            gen_len=8,
            turns=10,
            obs=56,
        ),
        dict(
            name="tiny 6 turns 16x(200+32+100)",
            preset=TINY,
            stage="rollout",
            num_seqs=16,
            context=200,
            gen_len=32,
            turns=6,
            obs=100,
        ),
        dict(
            name="wide-vocab train 4x256",
            preset=TINY,
            stage="train",
            num_seqs=4,
            context=256,
            **WIDE_VOCAB,
        ),
        dict(
            name="wide-vocab experience 16x256",
            preset=TINY,
            stage="experience",
            num_seqs=16,
            context=256,
            **WIDE_VOCAB,
        ),
        # the scored last layer (train/scored.py): one position in 8 scores an action, as in a multi-turn chat
        dict(
            name="tiny train 8x256 scored 1/8",
            preset=TINY,
            stage="train",
            num_seqs=8,
            context=256,
            scored=8,
        ),
        dict(
            name="wide-vocab train 8x512 scored 1/8",
            preset=TINY,
            stage="train",
            num_seqs=8,
            context=512,
            scored=8,
            **WIDE_VOCAB,
        ),
        dict(
            name="wide-vocab experience 32x512 scored",
            preset=TINY,
            stage="experience",
            num_seqs=32,
            context=512,
            scored=8,
            **WIDE_VOCAB,
        ),
    ],
    "100m": [
        dict(name="100M train 2x128", preset=M100, stage="train", num_seqs=2, context=128),
        dict(
            name="100M rollout 4x256+16",
            preset=M100,
            stage="rollout",
            num_seqs=4,
            context=256,
            gen_len=16,
        ),
    ],
}


# ---- worker (runs in the subprocess) -------------------------------------------------------
def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model(spec: dict, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from earl_lightning.models.tiny import PRESETS, tiny_config

    cfg = tiny_config(
        spec.get("vocab", 104), **{**PRESETS[spec["preset"]], **spec.get("overrides", {})}
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)


def _batch(spec: dict, device: str):
    import torch

    from earl_lightning.batches.experience import ExperienceBatch

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (spec["context"],), generator=g) for _ in range(spec["num_seqs"])]
    n, every = (
        len(seqs),
        spec.get("scored", 1),
    )  # every `every`-th token an action (all of them by default)
    masks = [(torch.arange(len(s)) % every == every - 1).long() for s in seqs]
    return ExperienceBatch.from_sequences(
        {"input_ids": seqs, "action_mask": masks},
        {"rewards": torch.zeros(n), "group_ids": torch.arange(n), "episode_ids": torch.arange(n)},
    ).to(device)


def _run_train(spec: dict, device: str) -> None:
    import torch

    from earl_lightning.train.forward import forward_micro_batch

    model = _model(spec, device)
    if spec.get("ckpt"):
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # Adam states exist from step 2 on: measure that steady state
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    res = forward_micro_batch(model, _batch(spec, device), temperature=1.0, scored="scored" in spec)
    (-res["logprobs"].mean()).backward()
    del res
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run_experience(spec: dict, device: str) -> None:
    import torch

    from earl_lightning.train.forward import forward_micro_batch

    model = _model(spec, device).eval()
    with torch.no_grad():
        forward_micro_batch(model, _batch(spec, device), temperature=1.0, scored="scored" in spec)


def play_turns(backend, spec: dict) -> dict[str, float]:
    """``spec["turns"]`` (default 1) calls of ``backend`` for ``spec["num_seqs"]`` random prompts of
    ``spec["context"]`` tokens, each later turn adding ``spec["obs"]`` observation tokens; returns
    the final sequences' ``context_stats``, by which the next step's rollout is sized."""
    import torch

    from earl_lightning.batches.experience import ExperienceBatch
    from earl_lightning.rollout.backends import GenRequest, SamplingConfig

    g = torch.Generator().manual_seed(0)
    ids = [
        torch.randint(3, 100, (spec["context"],), generator=g).tolist()
        for _ in range(spec["num_seqs"])
    ]
    masks = [[0] * len(c) for c in ids]
    for turn in range(spec.get("turns", 1)):
        if turn:  # the environment answers every episode
            obs = [torch.randint(3, 100, (spec["obs"],), generator=g).tolist() for _ in ids]
            ids, masks = (
                [c + o for c, o in zip(ids, obs)],
                [m + [0] * len(o) for m, o in zip(masks, obs)],
            )
        outs = backend.generate(
            [GenRequest(k, c) for k, c in enumerate(ids)],
            SamplingConfig(max_new_tokens=spec["gen_len"], seed=turn),
        )
        ids = [c + o.token_ids for c, o in zip(ids, outs)]
        masks = [m + [1] * len(o.token_ids) for m, o in zip(masks, outs)]
    n = len(ids)
    exp = ExperienceBatch.from_sequences(
        {
            "input_ids": [torch.tensor(c) for c in ids],
            "action_mask": [torch.tensor(m) for m in masks],
        },
        {"rewards": torch.zeros(n), "group_ids": torch.arange(n), "episode_ids": torch.arange(n)},
    )
    return exp.context_stats()


def _run_rollout(spec: dict, device: str) -> dict[str, float]:
    from earl_lightning.models.tiny import build_char_tokenizer
    from earl_lightning.rollout.backends.hf import HFBackend

    return play_turns(HFBackend(_model(spec, device), build_char_tokenizer()), spec)


RUNNERS = {"train": _run_train, "experience": _run_experience, "rollout": _run_rollout}


def _measure(spec: dict, device: str) -> dict:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _proc_status("VmRSS")
    t0 = time.perf_counter()
    stats = RUNNERS[spec["stage"]](spec, device)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _proc_status("VmHWM")
    return {"measured": peak - base, "seconds": time.perf_counter() - t0, "stats": stats}


def worker(specs: list[dict], device: str) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    for stage, run in RUNNERS.items():  # warm-up: load kernels and code pages before measuring
        run(dict(preset=TINY, stage=stage, num_seqs=2, context=8, gen_len=2), device)
    overhead = _measure(dict(preset=TINY, stage="train", num_seqs=1, context=8), device)["measured"]
    return [{**s, **_measure(s, device), "minimal_train_step": overhead} for s in specs]


# ---- the test ------------------------------------------------------------------------------
def _estimate(spec: dict) -> int:
    from earl_lightning.models.tiny import PRESETS, tiny_config
    from earl_lightning.parallel.layout import Layout
    from earl_lightning.parallel.memory import MemoryModel

    cfg = tiny_config(
        spec.get("vocab", 104), **{**PRESETS[spec["preset"]], **spec.get("overrides", {})}
    )
    c = spec["context"]
    stats = dict(
        num_seqs=spec["num_seqs"],
        context_mean=c,
        context_max=c,
        context_p95=c,
        gen_len=spec.get("gen_len", 0),
    )
    if spec["stage"] == "rollout":  # sized as the selector sizes it: by the final sequences' stats
        stats.update(spec["stats"])
    if "scored" in spec:
        stats.update(scored_max=c // spec["scored"], scored_share_max=(c // spec["scored"]) / c)
    # one micro-batch holding the whole batch, as the worker runs it
    layout = Layout(micro_batch_tokens=1 << 20, activation_checkpointing=bool(spec.get("ckpt")))
    from earl_lightning.train.scored import MAX_SCORED_SHARE

    return (
        MemoryModel(cfg, scored_share_limit=MAX_SCORED_SHARE if "scored" in spec else None)
        .estimate(spec["stage"], layout, stats)
        .total
    )


def _run_worker(specs: list[dict], device: str) -> list[dict]:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="131072",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps({"specs": specs, "device": device})],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT "))


def _check(results: list[dict]) -> None:
    print(f"\n{'case':32s} {'estimate MiB':>12s} {'measured MiB':>12s} {'error':>7s} {'secs':>5s}")
    bad = []
    for r in results:
        est = _estimate(r)
        err = est / r["measured"] - 1
        print(
            f"{r['name']:32s} {est / 2**20:12.1f} {r['measured'] / 2**20:12.1f} {err:+7.1%} {r['seconds']:5.1f}"
        )
        if abs(err) > TOLERANCE:
            bad.append((r["name"], est, r["measured"]))
    print(
        f"minimal train step (1x8 tokens, tiny) after warm-up: {results[0]['minimal_train_step'] / 2**20:.1f} MiB"
    )
    assert not bad, f"estimates off by more than {TOLERANCE:.0%}: {bad}"


def _device_params():
    import torch

    return [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
        ),
    ]


@pytest.fixture(scope="module")
def measured(request):
    """``measured(group, device)``: the group's results, from one worker a device that measures
    every group this session runs on it, in the order of ``SPECS`` (each worker is an interpreter
    that imports torch and transformers and warms up: ~9 s of CPU, paid once, not once a group)."""
    selected = {
        (item.callspec.params["group"], item.callspec.params["device"])
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    results: dict[str, list[dict]] = {}

    def get(group: str, device: str) -> list[dict]:
        if device not in results:
            groups = [g for g in SPECS if (g, device) in selected | {(group, device)}]
            results[device] = _run_worker([s for g in groups for s in SPECS[g]], device)
        names = {s["name"] for s in SPECS[group]}
        return [r for r in results[device] if r["name"] in names]

    return get


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset needs Linux /proc")
@pytest.mark.parametrize("device", _device_params())
# 100m: ~15 s of CPU
@pytest.mark.parametrize("group", ["tiny", pytest.param("100m", marks=pytest.mark.slow)])
def test_estimates_within_30_percent_of_measured_peaks(group, device, measured):
    results = measured(group, device)
    assert [r["name"] for r in results] == [s["name"] for s in SPECS[group]]
    _check(results)


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    out = worker(args["specs"], args["device"])
    print("RESULT " + json.dumps(out), flush=True)
