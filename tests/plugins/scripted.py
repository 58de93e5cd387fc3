"""A scripted demonstration policy for rollouts through ``PolicyBackend``: it says its words in
order, then keeps saying the last one."""

from __future__ import annotations


class Says:
    def __init__(self, *words: str) -> None:
        self.words = list(words)

    def __call__(self, observation: str) -> str:
        return self.words.pop(0) if len(self.words) > 1 else self.words[0]
