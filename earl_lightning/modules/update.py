"""The policy (and value) update of one RL iteration: epochs x mini-batches x micro-batches.

Loss denominators are global (all micro-batches of all data-parallel ranks of a mini-batch), so
the summed gradient equals the gradient of the whole mini-batch's loss computed at once, whatever
the layout and the micro-batch token budget: this is what makes layouts numerically equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from earl_lightning.algorithms import aggregate, kl_divergence, ppo_clip_loss, value_loss
from earl_lightning.data.experience import ExperienceBatch
from earl_lightning.modules.experience_ops import forward_micro_batch
from earl_lightning.parallel.layout import Layout


@dataclass
class UpdateConfig:
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batch_tokens: int = 16384
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: str = "token_mean"
    norm_constant: float = 4096.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    value_clip: float = 0.2
    max_grad_norm: float = 1.0
    allowed_token_ids: list[int] | None = None


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sum_all(values: list[float], layout: Layout | None = None) -> list[float]:
    """Sum over ranks; members of a TP group hold the same rows, so only TP rank 0 contributes."""
    t = torch.tensor(values, dtype=torch.float64)
    if _world() > 1:
        if layout is not None and layout.coords(dist.get_rank())[1] != 0:
            t.zero_()
        dist.all_reduce(t)
    return t.tolist()


def _max_all(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    if _world() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def mini_batch_indices(batch: ExperienceBatch, n: int) -> list[list[int]]:
    """Split sequences into ``n`` contiguous mini-batches (deterministic, same on every rank)."""
    s = batch.num_seqs
    bounds = [round(i * s / n) for i in range(n + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n)]


def micro_batch_loss(module, mb: ExperienceBatch, cfg: UpdateConfig, denom: dict) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch, scaled so that summing over micro-batches and ranks gives the
    mini-batch loss. Returns the loss and un-normalized stat sums."""
    value_head = getattr(module, "value_head", None)
    res = forward_micro_batch(module.policy, mb, temperature=cfg.temperature, value_head=value_head,
                              with_entropy=True, allowed=cfg.allowed_token_ids)
    mask = mb.padded("action_mask", 0.0)
    logp, old = mb.pad(res["logprobs"], 0.0), mb.padded("old_logprobs", 0.0)
    adv = mb.padded("advantages", 0.0)
    tok_loss, pstats = ppo_clip_loss(logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    agg = dict(num_tokens=denom["tokens"], num_seqs=denom["seqs"], norm_constant=cfg.norm_constant)
    loss = aggregate(tok_loss, mask, cfg.loss_agg, **agg)
    ent = mb.pad(res["entropy"], 0.0)
    stats = {"loss/policy": float(loss.detach()), "policy/entropy": float((ent.detach() * mask).sum() / denom["tokens"]),
             "policy/clip_frac": float(pstats.clip_frac) * float(mask.sum()) / denom["tokens"],
             "policy/approx_kl": float(pstats.approx_kl) * float(mask.sum()) / denom["tokens"]}
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * aggregate(ent, mask, cfg.loss_agg, **agg)
    if cfg.kl_coef and "ref_logprobs" in mb.tokens:
        kl = kl_divergence(logp, mb.padded("ref_logprobs", 0.0), mask, cfg.kl_estimator)
        kl_loss = aggregate(kl, mask, cfg.loss_agg, **agg)
        loss = loss + cfg.kl_coef * kl_loss
        stats["loss/kl"] = float(kl_loss.detach())
    if value_head is not None:
        v = mb.pad(res["values"], 0.0)
        vl, _ = value_loss(v, mb.padded("values", 0.0), mb.padded("returns", 0.0), mask, value_clip=cfg.value_clip)
        vloss = aggregate(vl, mask, "token_mean", num_tokens=denom["tokens"])
        loss = loss + cfg.value_coef * vloss
        stats["loss/value"] = float(vloss.detach())
    return loss, stats


def _dummy_loss(module) -> torch.Tensor:
    """A zero loss through every parameter, for ranks with fewer micro-batches than others:
    collective-backed parameters (FSDP, TP) need every rank in every forward/backward."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=module.device)
    out = module.policy(input_ids=ids, use_cache=False, output_hidden_states=module.value_head is not None)
    loss = out.logits.sum() * 0.0
    if module.value_head is not None:
        loss = loss + module.value_head(out.hidden_states[-1].float()).sum() * 0.0
    return loss


def ppo_update(module, batch: ExperienceBatch, cfg: UpdateConfig, layout: Layout | None = None) -> dict[str, float]:
    opt = module.optimizers()
    sched = module.lr_schedulers()
    totals: dict[str, float] = {}
    grad_norms = []
    for _epoch in range(cfg.ppo_epochs):
        for idx in mini_batch_indices(batch, cfg.mini_batches):
            mini = batch.select(idx)
            mask_tok = mini.tokens["action_mask"]
            seqs_with_actions = float((mini.pad(mask_tok, 0.0).sum(-1) > 0).sum()) if mini.num_seqs else 0.0
            tokens, seqs = _sum_all([float(mask_tok.sum()), seqs_with_actions], layout)
            denom = {"tokens": max(tokens, 1.0), "seqs": max(seqs, 1.0)}
            micro = mini.split_by_tokens(cfg.micro_batch_tokens) if mini.num_seqs else []
            # Every rank runs as many forward/backward passes as the busiest one, in lockstep
            # (FSDP and TP collectives inside each pass): agree on the count first, then pad with
            # zero-loss passes.
            for i in range(_max_all(len(micro))):
                if i >= len(micro):
                    module.manual_backward(_dummy_loss(module))
                    continue
                loss, stats = micro_batch_loss(module, micro[i], cfg, denom)
                module.manual_backward(loss)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
            _sync_replicated_grads(module, layout)
            grad_norms.append(_clip(module, cfg.max_grad_norm))
            last = len(grad_norms) == cfg.ppo_epochs * cfg.mini_batches
            # One Lightning training step is one RL iteration, and `trainer.max_steps` counts them:
            # only the iteration's last optimizer step goes through the LightningOptimizer, whose
            # step advances `global_step`; the others step the wrapped optimizer directly.
            (opt if last else opt.optimizer).step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    steps = cfg.ppo_epochs * cfg.mini_batches
    keys = sorted(totals)
    summed = _sum_all([totals[k] for k in keys], layout)
    out = {k: v / steps for k, v in zip(keys, summed)}
    out["grad_norm"] = float(sum(grad_norms) / max(1, len(grad_norms)))
    out["lr"] = float(opt.param_groups[0]["lr"])
    return out


def _sync_replicated_grads(module, layout: Layout | None) -> None:
    """Plain (non-DTensor) trainable parameters, e.g. PPO's value head, are replicated on every
    rank and not managed by FSDP: sum their gradients over data-parallel ranks ourselves (TP peers
    computed identical ones, hence the division by tp)."""
    if _world() == 1:
        return
    tp = layout.tp if layout is not None else 1
    for p in module.parameters():
        if p.grad is not None and not hasattr(p, "device_mesh"):
            dist.all_reduce(p.grad)
            if tp > 1:
                p.grad.div_(tp)


def _clip(module, max_norm: float) -> float:
    """Clip all gradients by their global 2-norm; returns that norm.

    Sharded (DTensor) gradients of the FSDP/TP policy and plain ones (PPO's value head, replicated)
    cannot go through one ``clip_grad_norm_`` call (torch refuses to mix them), so each kind's norm
    is taken on its own and the two are combined; with one kind this is ``clip_grad_norm_``."""
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return 0.0
    groups = [[p for p in params if hasattr(p.grad, "device_mesh")],
              [p for p in params if not hasattr(p.grad, "device_mesh")]]
    groups = [g for g in groups if g]
    norms = []
    for g in groups:
        n = torch.nn.utils.get_total_norm([p.grad for p in g], 2.0)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = norms[0] if len(norms) == 1 else torch.stack([n.float().cpu() for n in norms]).norm()
    if max_norm > 0:
        for g, n in zip(groups, norms):
            torch.nn.utils.clip_grads_with_norm_(g, max_norm, total.to(n.device))
    return float(total)
