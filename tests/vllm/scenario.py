"""One multi-process vLLM scenario, run under torchrun by tests/vllm and tests/gpu (a vLLM engine
takes ~15 s to build on CPU, so every check shares the same few engines).

Each rank writes a JSON of measurements to ``$EARL_SCENARIO_OUT/rank<r>.json``; the tests assert
on them. Steps:
1. TP 1 (one engine per rank): two-turn generation with prefix caching; log-probs vs the HF
   recompute on the starting weights; stop strings; greedy. Then the rollout loop with a tool
   environment whose calls take different times: continuous turns equal lock-step ones.
2. A training step changes the (FSDP2-sharded) training copy; weights are synced bucket by
   bucket; the mismatch vs the HF recompute is measured.
3. Another training step without sync: the stale mismatch is measured and the warning checked.
4. Switch to TP 2 (one engine over both ranks), sync, generate: mismatch, tokens equal on both
   ranks, switch seconds.
5. An engine build that runs out of KV memory, then the retry at another TP degree through
   ``prepare(layout)`` (rebuild + weight sync).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist


def hf_logprobs(
    model, prompt: list[int], gen: list[int], temperature: float, allowed: list[int] | None = None
) -> torch.Tensor:
    """[len(gen)] log-probs of ``gen`` after ``prompt`` under softmax(logits / temperature), over
    the ``allowed`` tokens only when given (the trainer's helper, the function under test's peer)."""
    from earl_lightning.algorithms import logprobs_from_logits

    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [G, V]
    if allowed is not None:
        return logprobs_from_logits(logits, torch.tensor(gen), temperature, torch.tensor(allowed))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(gen).unsqueeze(-1)).squeeze(-1)


def mismatch(
    model, requests, outputs, temperature: float, allowed: list[int] | None = None
) -> float:
    from earl_lightning.rollout.weight_sync import logprob_mismatch

    worst = 0.0
    for req, out in zip(requests, outputs):
        ref = hf_logprobs(model, req.prompt_ids, out.token_ids, temperature, allowed)
        got = torch.tensor(out.logprobs)
        worst = max(worst, float(logprob_mismatch(got, ref, torch.ones_like(got))))
    return worst


def train_step(model, tokens: list[int], lr: float) -> None:
    """A real optimizer step on the (sharded) training copy: raise the likelihood of ``tokens``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ids = torch.tensor([tokens])
    loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_copy(sharded, reference):
    """An unsharded HF model holding the sharded copy's current weights (the recompute model)."""
    from earl_lightning.rollout.weight_sync import stream_full_weights

    state = dict(stream_full_weights(sharded))
    reference.load_state_dict(state, strict=False)
    return reference


class Run:
    """What the steps share: the engine, the training copy (FSDP2), the HF reference, the tokenizer,
    the first requests and their outputs, and ``res``, the measurements written at the end."""

    def __init__(self, rank: int, world: int) -> None:
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        from earl_lightning.models import load_tokenizer, make_tiny_model
        from earl_lightning.rollout.backends.base import SamplingConfig
        from earl_lightning.rollout.backends.vllm import VLLMBackend

        path = str(make_tiny_model("earl-tiny"))
        self.rank, self.world, self.tok = rank, world, load_tokenizer(path)
        torch.manual_seed(0)
        self.train = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        fully_shard(self.train)  # FSDP2: every parameter is a DTensor Shard(0) over the world
        self.ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.res: dict = {"rank": rank, "world": world}
        self.backend = VLLMBackend(
            path, self.tok, tp=1, seed=0, kv_cache_gib=0.0625, max_model_len=1024
        )
        self.sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, seed=123)
        self.chat = self.encode_chat(f"hello from rank {rank}")
        self.reqs: list = []
        self.first: list = []

    def encode_chat(self, content: str) -> list[int]:
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return self.tok.encode(text, add_special_tokens=False)

    def mismatch(self, requests, outputs, allowed: list[int] | None = None) -> float:
        return mismatch(self.ref, requests, outputs, 0.8, allowed)


def tp1_generation(run: Run) -> None:
    """Step 1: two turns with prefix caching, repeatability, greedy vs HF, allowed tokens, stop strings."""
    from earl_lightning.rollout.backends.base import GenRequest, SamplingConfig

    backend, res, tok, sampling = run.backend, run.res, run.tok, run.sampling
    res["sleep_enabled"] = backend.enable_sleep
    run.reqs = reqs = [
        GenRequest(key=10 * run.rank + i, prompt_ids=run.chat + [5 + i]) for i in range(3)
    ]
    t0 = time.perf_counter()
    run.first = first = backend.generate(reqs, sampling)
    res["tp1_first_generate_s"] = time.perf_counter() - t0
    res["tp1_build_s"] = backend.stats
    res["tp1_mismatch_initial"] = run.mismatch(reqs, first)
    # Turn 2: the whole context so far + new tokens, like the rollout loop sends.
    reqs2 = [GenRequest(r.key, r.prompt_ids + o.token_ids + [1, 6, 7]) for r, o in zip(reqs, first)]
    second = backend.generate(reqs2, sampling)
    res["tp1_mismatch_turn2"] = run.mismatch(reqs2, second)
    res["tp1_lengths"] = [len(o.token_ids) for o in first + second]
    res["tp1_finish"] = [o.finish_reason for o in first + second]
    res["tp1_repeat_same"] = [o.token_ids for o in backend.generate(reqs, sampling)] == [
        o.token_ids for o in first
    ]
    greedy = backend.generate(reqs[:1], SamplingConfig(max_new_tokens=6, greedy=True))[0]
    with torch.no_grad():
        g_ref = run.ref.generate(
            torch.tensor([reqs[0].prompt_ids]), max_new_tokens=6, do_sample=False
        )[0, len(reqs[0].prompt_ids) :]
    res["greedy_equal_hf"] = greedy.token_ids == g_ref.tolist()[: len(greedy.token_ids)]
    res["greedy_logprobs"] = greedy.logprobs
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(7)]
    restricted = backend.generate(
        reqs, SamplingConfig(max_new_tokens=6, temperature=0.8, seed=5, allowed_token_ids=digits)
    )
    res["allowed"] = {
        "tokens": [t for o in restricted for t in o.token_ids],
        "ids": digits,
        "mismatch": run.mismatch(reqs, restricted, digits),
        "unrestricted_mismatch": run.mismatch(reqs, restricted),
    }
    stop_text = tok.decode([first[0].token_ids[3]])
    stopped = backend.generate(
        reqs[:1], SamplingConfig(max_new_tokens=12, temperature=0.8, seed=123, stop=[stop_text])
    )[0]
    res["stop"] = {
        "text": stop_text,
        "finish": stopped.finish_reason,
        "ids": stopped.token_ids,
        "decoded": tok.decode(stopped.token_ids),
        "unstopped": first[0].token_ids,
    }


def tool_rollout(run: Run) -> None:
    """Step 1b: the rollout loop on the vLLM backend with a tool-offering environment whose calls
    take a time that differs per episode: continuous turns give the same episodes as lock-step ones
    (each request's sampling seed is its own), and every prompt carries the tools."""
    from earl_lightning.rollout import EpisodeSpec, rollout
    from earl_lightning.rollout.loop import ToolUse
    from earl_lightning.tasks.tool_parsers import hermes

    specs = [
        EpisodeSpec("tests.plugins.tools.Sleepy", seed=s, group_id=s, episode_id=100 + s)
        for s in range(4)
    ]
    kw = dict(max_turns=3, max_context_tokens=1024, tools=ToolUse(hermes))
    lock = rollout(specs, run.backend, run.tok, run.sampling, continuous=False, **kw)
    cont = rollout(specs, run.backend, run.tok, run.sampling, continuous=True, **kw)
    run.res["tools_continuous_equal"] = [(a.token_ids, a.messages) for a in lock] == [
        (b.token_ids, b.messages) for b in cont
    ]
    run.res["tools_turns"] = [ep.num_turns for ep in cont]
    run.res["tools_in_prompt"] = all(
        '"name": "nap"' in run.tok.decode(ep.token_ids[: ep.prompt_tokens]) for ep in cont
    )


def sync_then_stale(run: Run) -> None:
    """Steps 2 and 3: a training step, then the bucketed sync; another step without sync (stale)."""
    from earl_lightning.rollout.weight_sync import check_logprob_mismatch, sync_weights

    backend, res, reqs, first = run.backend, run.res, run.reqs, run.first
    backend.sleep()
    train_step(run.train, reqs[0].prompt_ids + first[0].token_ids, lr=2.0)
    report = sync_weights(run.train, backend, bucket_bytes=1 << 16)
    res["sync"] = {
        "tensors": report.num_tensors,
        "bytes": report.num_bytes,
        "seconds": report.seconds,
    }
    full_copy(run.train, run.ref)
    after = backend.generate(reqs, run.sampling)
    res["tp1_mismatch_after_sync"] = run.mismatch(reqs, after)
    res["tp1_changed_by_sync"] = [o.token_ids for o in after] != [o.token_ids for o in first]
    train_step(run.train, reqs[1].prompt_ids + first[1].token_ids, lr=2.0)
    full_copy(run.train, run.ref)
    res["tp1_mismatch_stale"] = run.mismatch(reqs, backend.generate(reqs, run.sampling))
    from earl_lightning.core import console

    caught = _Kept()  # the warning is a record of the earl_lightning logger (rank zero only)
    console.LOGGER.addHandler(caught)
    try:
        res["stale_flagged"] = check_logprob_mismatch(res["tp1_mismatch_stale"])
    finally:
        console.LOGGER.removeHandler(caught)
    res["stale_warning"] = caught.messages


class _Kept(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tp2_switch(run: Run) -> None:
    """Step 4: both ranks drive one TP 2 engine with the same requests; then back to TP 1."""
    from earl_lightning.rollout.backends.base import GenRequest
    from earl_lightning.rollout.weight_sync import sync_weights

    backend, res, sampling = run.backend, run.res, run.sampling
    res["tp2_switch_s"] = backend.set_tp(2)
    sync_weights(run.train, backend)
    common = run.encode_chat("same on every rank")
    shared = [GenRequest(key=100 + i, prompt_ids=[9 + i] + common) for i in range(4)]
    tp2 = backend.generate(shared, sampling)
    res["tp2_mismatch"] = run.mismatch(shared, tp2)
    res["tp2_tokens"] = [o.token_ids for o in tp2]
    res["tp2_engine_ranks"] = backend._tp_group().ranks
    try:
        backend.generate([GenRequest(key=999, prompt_ids=run.chat + [run.rank + 5])], sampling)
        res["tp2_disagree_error"] = None
    except RuntimeError as err:
        res["tp2_disagree_error"] = str(err)
    res["tp1_back_switch_s"] = backend.set_tp(1)
    sync_weights(run.train, backend)
    res["tp1_back_mismatch"] = run.mismatch(run.reqs, backend.generate(run.reqs, sampling))
    res["engines_built"] = backend.stats["engines_built"]


def oom_then_retry(run: Run) -> None:
    """Step 5: an engine build that runs out of KV memory (what the selector's OOM retry catches)
    must not leave vLLM's parallel groups behind: the retry at another TP degree builds, gets the
    trainer's current weights (prepare syncs a fresh engine: the checkpoint on disk is stale by
    now) and generates correctly."""
    from earl_lightning.parallel.layout import Layout
    from earl_lightning.parallel.oom import is_oom_error

    backend, res = run.backend, run.res
    backend.kv_cache_gib = 1 / 4096  # 256 tokens of KV, less than one max_model_len sequence
    try:
        backend.set_tp(2)
        res["oom_build_error"] = None
    except ValueError as err:
        res["oom_build_error"], res["oom_is_oom"] = str(err)[:300], is_oom_error(err)
    backend.kv_cache_gib = 0.0625
    backend.weights_source = run.train
    res["retry_switch_s"] = backend.prepare(Layout(dp=run.world, tp=1))
    res["retry_mismatch"] = run.mismatch(run.reqs, backend.generate(run.reqs, run.sampling))
    res["retry_tp"] = backend.tp


def main() -> None:
    if os.environ.get("EARL_SCENARIO_DEVICE") == "cuda":  # vLLM's TP all-reduce runs on NCCL on GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    run = Run(dist.get_rank(), dist.get_world_size())
    for step in (tp1_generation, tool_rollout, sync_then_stale, tp2_switch, oom_then_retry):
        step(run)
    run.backend.shutdown()
    with open(os.path.join(os.environ["EARL_SCENARIO_OUT"], f"rank{run.rank}.json"), "w") as f:
        json.dump(run.res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
