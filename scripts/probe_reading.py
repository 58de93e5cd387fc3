"""Can the default model learn to read "this column is full" from a Connect Four observation, and
does a policy gradient get it there? A diagnostic for issue 2's invalid-action criterion.

Same model (``earl-tiny``'s config, random weights, fixed seed), same observations, same optimizer
and step count in every arm; only the learning signal differs:

- ``supervised``: cross-entropy to the highest legal column (a target that changes with the state);
- ``policy_gradient``: the same task by trial and error: sample a column (the model's distribution
  restricted to the seven digits, so every column is tried from the start), reward 1
  if it is the highest legal column, else 0; REINFORCE with a batch-mean baseline. A contextual
  bandit on the very states of the supervised arm: a cleaner per-move signal than any game gives
  (no credit assignment over a game at all);
- ``actor_critic``: the same, with a value head on the shared trunk trained to predict the reward
  (MSE) and used as the baseline, so the trunk gets a supervised signal that depends on the board.

Observations come from scripted games (column 6 with p 0.6, else a uniform legal column, after up to
12 random opening plies), so about a quarter of them have column 6 full. Reported every
``--eval-every`` steps on held-out games: how often the greedy column is legal where column 6 is
full (0 for "always 6", the majority answer), and how much the answer varies across states at all
(mean over the seven digits of the standard deviation across states of their log-probability among
the digits; ~0 means the answer ignores the board).

    python scripts/probe_reading.py --steps 300 --out docs/reading_probe.csv
"""

from __future__ import annotations

import argparse
import csv
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from earl_lightning.envs.openspiel_env import OpenSpielEnv, legal_from_observation
from earl_lightning.models.tiny import build_char_tokenizer, tiny_config


ARMS = ("supervised", "policy_gradient", "actor_critic")


def scripted_contexts(tok, games: int, seed0: int, multi_turn: bool) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, legal columns) for every agent turn of ``games`` scripted games."""
    out = []
    for g in range(games):
        env, rng = OpenSpielEnv(random_opening=12), random.Random(seed0 + g)
        obs, messages = env.reset(seed0 + g), []
        while True:
            legal = legal_from_observation(obs)
            messages.append({"role": "user", "content": obs})
            ids = tok.apply_chat_template(messages if multi_turn else messages[-1:], add_generation_prompt=True,
                                          tokenize=True)
            out.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), legal))
            move = 6 if 6 in legal and rng.random() < 0.6 else rng.choice(legal)
            messages.append({"role": "assistant", "content": str(move)})
            result = env.step(str(move))
            if result.done:
                break
            obs = result.observation
    return out


def answer_logits(model, prompts: list[list[int]], hidden: bool = False):
    """Next-token logits after each (left-padded) prompt (and the last hidden state there)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, p in enumerate(prompts):
        ids[k, width - len(p):] = torch.tensor(p)
        mask[k, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=hidden)
    return (out.logits[:, -1].float(), out.hidden_states[-1][:, -1].float()) if hidden else out.logits[:, -1].float()


@torch.no_grad()
def evaluate(model, test, digits) -> tuple[float, float]:
    """(greedy-legal rate where column 6 is full, answer sensitivity to the state)."""
    model.eval()
    logp = torch.cat([answer_logits(model, [p for p, _ in test[i:i + 128]])[:, digits].log_softmax(-1)
                      for i in range(0, len(test), 128)])  # over the seven columns
    model.train()
    full = [k for k, (_, legal) in enumerate(test) if 6 not in legal]
    greedy = logp.argmax(-1)
    legal_rate = sum(int(greedy[k]) in test[k][1] for k in full) / max(len(full), 1)
    return legal_rate, logp.std(0).mean().item()


def run_arm(arm: str, train, test, tok, args) -> list[dict]:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from transformers import AutoModelForCausalLM

    config = tiny_config(vocab_size=((len(tok) + 7) // 8) * 8)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    critic = torch.nn.Linear(model.config.hidden_size, 1)  # a value head on the shared trunk
    opt = torch.optim.AdamW([*model.parameters(), *critic.parameters()], lr=args.lr, weight_decay=0.0)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(7)]
    rows, t0 = [], time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            legal_rate, sensitivity = evaluate(model, test, digits)
            seconds = round(time.perf_counter() - t0, 1)
            rows.append(dict(arm=arm, step=step, column6_full_greedy_legal=round(legal_rate, 3),
                             answer_sensitivity=round(sensitivity, 5), seconds=seconds))
            print(f"{arm:>16} {step:>5} {legal_rate:>10.3f} {sensitivity:>12.5f} {seconds:>8}", flush=True)
        if step == args.steps:
            break
        batch = rng.sample(train, args.batch)
        logits, last_hidden = answer_logits(model, [p for p, _ in batch], hidden=True)
        if arm == "supervised":
            loss = F.cross_entropy(logits, torch.tensor([digits[max(legal)] for _, legal in batch]))
        else:
            logp = logits[:, digits].log_softmax(-1)  # the action space is the seven columns
            with torch.no_grad():
                action = torch.distributions.Categorical(logits=logp).sample()
                reward = torch.tensor([float(int(a) == max(legal)) for a, (_, legal) in zip(action, batch)])
            value = critic(last_hidden).squeeze(-1)
            critic_coef = 1.0 if arm == "actor_critic" else 0.0
            baseline = value.detach() if critic_coef else reward.mean()
            loss = -((reward - baseline) * logp[torch.arange(len(batch)), action]).mean()
            loss = loss + critic_coef * F.mse_loss(value, reward)
            entropy = -(logp.exp() * logp).sum(-1).mean()
            loss = loss - args.entropy_coef * entropy
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus of the policy-gradient arms")
    ap.add_argument("--multi-turn", action="store_true",
                    help="prompt = the whole chat so far (as in training) instead of the current observation")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--games", type=int, nargs=2, default=(600, 150), metavar=("TRAIN", "TEST"),
                    help="scripted games whose states make the training and the held-out set")
    ap.add_argument("--out", type=Path, default=Path("docs/reading_probe.csv"))
    args = ap.parse_args(argv)
    tok = build_char_tokenizer()
    train = scripted_contexts(tok, args.games[0], 0, args.multi_turn)
    test = scripted_contexts(tok, args.games[1], 10_000, args.multi_turn)
    print(f"{len(train)} train / {len(test)} test states, "
          f"{sum(6 not in legal for _, legal in test) / len(test):.0%} of test states with column 6 full")
    print(f"{'arm':>16} {'step':>5} {'legal@6full':>10} {'sensitivity':>12} {'seconds':>8}")
    rows = [r for arm in args.arms for r in run_arm(arm, train, test, tok, args)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
