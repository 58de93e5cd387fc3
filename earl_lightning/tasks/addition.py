"""The built-in addition task's second scorer (``scripts/make_addition.py`` writes its rows).

``trl.rewards.accuracy_reward`` (math-verify) is the task's reward: it reads a ``\\boxed{...}``
answer only. :func:`answer_value` reads the answer in any form (the last integer of the
completion), so a recipe can log, at weight 0, whether the sum itself is right apart from the form
the verifier reads: what RL changes in the form and what it changes in the arithmetic.
"""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?\d+")


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")


def answer_value(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion's last integer is ``solution``, whatever form it is written in."""
    out = []
    for completion, gold in zip(completions, solution):
        found = _INT.findall(_text(completion))
        out.append(1.0 if found and found[-1] == str(gold).strip() else 0.0)
    return out
