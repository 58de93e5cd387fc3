"""Write the calculator warm start's demonstrations as TRL's tool-calling rows.

    python scripts/make_calculator_rows.py                 # -> data/calculator_rows/train.jsonl
    earl sft --config recipes/calculator_sft_rows.yaml     # the warm start from these rows

The scripted demonstrator of ``recipes/calculator_sft.yaml`` (``imperfect_calculator``, the same
settings and episode seeds) plays its 15,000 episodes through the rollout; each transcript
becomes one ``messages`` row as a TRL user would write it: the question, an assistant message
``{"content": "", "tool_calls": [{"type": "function", "function": {"name": "calculate",
"arguments": {"expression": ...}}}]}``, the ``tool`` message with the result, the answer; plus an
``answer`` column (the right number). ``earl sft`` encodes each row to the very tokens the
demonstration's own row has (``tests/unit/test_calculator_rows.py``); what the rows cannot carry is
the policy's stated first-token mix (``targets: expected``): they train on the turns shown.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "calculator_sft.yaml"
_CALLS = re.compile(r"\s*<tool_call>.*?</tool_call>\s*", re.S)


def trl_messages(episode: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The episode's transcript in TRL's form: a turn that called tools has them as structured
    ``tool_calls`` and its other text (none, for the demonstrator) as ``content``."""
    from earl_lightning.rollout.scoring import transcript

    prompt, completion, _ = transcript(episode, tokenizer)
    out = []
    for m in [*prompt, *completion]:
        if m.get("tool_calls"):
            m = {**m, "content": _CALLS.sub("", m["content"]).strip()}
        out.append(m)
    return out


def demonstrations(
    recipe: Path, episodes: int | None, shown_no_tool_share: float | None = None
) -> tuple[list, Any]:
    """The recipe's demonstration episodes (its policy, seeds and rollout settings; the share
    of answers shown without the tool overridden when given) and the tokenizer they were played
    with."""
    from earl_lightning.sft import DemonstrationDataModule, WarmStartModule

    cfg = yaml.safe_load(recipe.read_text())
    data = dict(cfg["data"], seed=cfg.get("seed_everything", 0))
    if episodes is not None:
        data["num_episodes"] = episodes
    if shown_no_tool_share is not None:
        data["policy_kwargs"] = {
            **data["policy_kwargs"],
            "shown_no_tool_share": shown_no_tool_share,
        }
    module = WarmStartModule(model=cfg["model"]["model"], rollout=cfg["model"]["rollout"])
    dm = DemonstrationDataModule(**data)
    played, _ = dm.play(module)
    return played, module.tokenizer


def rows(played: list, tokenizer: Any) -> list[dict[str, Any]]:
    """One TRL row per demonstration episode that did not fail."""
    from earl_lightning.envs.calculator import make_question

    return [
        {
            "messages": trl_messages(ep, tokenizer),
            "answer": str(make_question(ep.spec.seed, ep.spec.env_kwargs["difficulty"])[1]),
        }
        for ep in played
        if ep.error is None
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the demonstrator's recipe")
    parser.add_argument(
        "--out", type=Path, default=Path("data/calculator_rows"), help="where train.jsonl goes"
    )
    parser.add_argument("--episodes", type=int, default=None, help="default: the recipe's")
    parser.add_argument(
        "--shown-no-tool-share",
        type=float,
        default=None,
        help="the share of rows that answer without the tool (default: the recipe's, 0.1; its "
        "policy's own mix is 0.75)",
    )
    args = parser.parse_args()
    played, tokenizer = demonstrations(args.recipe, args.episodes, args.shown_no_tool_share)
    out = rows(played, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    calls = sum(any(m.get("tool_calls") for m in r["messages"]) for r in out)
    print(f"wrote {len(out)} rows ({calls} with a tool call) to {path}")


if __name__ == "__main__":
    main()
