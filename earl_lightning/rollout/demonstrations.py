"""Demonstrations: a scripted policy plays the environment through the very rollout loop the RL
trainer uses, so its transcripts have exactly the rollout's chat template, history window and
assistant-token mask.

:class:`PolicyBackend` is a generation backend whose "model" is a policy ``observation -> action
text``: it encodes the action the way a model would have generated it under the recipe's
sampling settings (a stop string ends the turn there; a turn shorter than ``max_new_tokens`` ends
with eos when eos may be generated), and refuses an action the model could never generate.

A policy that also has a ``distribution(observation) -> {action: probability}`` method (the
built-in ``random_legal`` does) states what it *would* play, not only what it played: the backend
records, for each turn, the distribution of the first token of those actions
(:attr:`PolicyBackend.first_token_targets`), which the warm start trains on instead of the one
sampled action (``--data.targets expected``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

from earl_lightning.core.checks import is_real
from earl_lightning.core.errors import DemonstrationError
from earl_lightning.envs.policies import make_policy
from earl_lightning.rollout.backends.base import (
    GenOutput,
    GenRequest,
    SamplingConfig,
    check_requests,
)
from earl_lightning.rollout.loop import rollout
from earl_lightning.rollout.types import Episode, EpisodeSpec


class PolicyBackend:
    """Generation by scripted policies, one per request key.

    Args:
        policies: the policy of each episode (request key).
        tokenizer: the model's tokenizer (the actions are encoded with it).
        name: the policy's name as the config wrote it (``--data.policy``), for errors.
    """

    def __init__(
        self, policies: Mapping[int, Callable[[str], Any]], tokenizer: Any, name: str = "policy"
    ) -> None:
        self.policies, self.tokenizer, self.name = dict(policies), tokenizer, name
        # key -> per turn: {first token id: probability} of the policy's distribution (None: it has none)
        self.first_token_targets: dict[int, list[dict[int, float] | None]] = {}

    def generate(self, requests: list[GenRequest], sampling: SamplingConfig) -> list[GenOutput]:
        check_requests(requests)
        return [self._one(r, sampling) for r in requests]

    def _one(self, request: GenRequest, sampling: SamplingConfig) -> GenOutput:
        if request.observation is None:
            raise ValueError(
                "PolicyBackend needs each request's `observation` (the rollout loop sets it)"
            )
        policy = self.policies[request.key]
        try:
            action = policy(request.observation)
        except Exception as err:  # noqa: BLE001 - the user's policy: reported with what it was given
            raise DemonstrationError(
                f"demonstration policy {self.name!r} raised {type(err).__name__}: {err} "
                f"(observation {request.observation!r:.80})"
            ) from err
        if not isinstance(action, str):
            raise DemonstrationError(
                f"demonstration policy {self.name!r} returned {action!r:.80} (type {type(action).__name__}) for the "
                f"observation {request.observation!r:.80}; a policy must return the action as a string"
            )
        ids, finish = self._encode(action, sampling)
        targets = self._first_token_targets(policy, request, action, sampling)
        self.first_token_targets.setdefault(request.key, []).append(targets)
        return GenOutput(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish)

    def _first_token_targets(
        self, policy: Any, request: GenRequest, action: str, sampling: SamplingConfig
    ) -> dict[int, float] | None:
        """The first-token marginal of ``policy``'s ``distribution`` for this turn (None: it has none)."""
        if not callable(getattr(policy, "distribution", None)):
            return None
        where = f"demonstration policy {self.name!r}'s distribution for the observation {request.observation!r:.80}"
        try:
            dist = policy.distribution(request.observation)
        except Exception as err:  # noqa: BLE001 - the user's policy: reported with what it was given
            raise DemonstrationError(f"{where} raised {type(err).__name__}: {err}") from err
        if (
            not isinstance(dist, Mapping)
            or not dist
            or not all(isinstance(a, str) and is_real(p) and p >= 0 for a, p in dist.items())
        ):
            raise DemonstrationError(
                f"{where} is {dist!r:.80}; it must be a non-empty mapping of action strings to "
                f"probabilities >= 0"
            )
        total = float(sum(dist.values()))
        if abs(total - 1.0) > 1e-6:
            raise DemonstrationError(
                f"{where} sums to {total:.6g}; its probabilities must sum to 1"
            )
        if dist.get(action, 0.0) <= 0:
            raise DemonstrationError(
                f"{where} gives the action it played, {action!r:.40}, probability 0"
            )
        out: dict[int, float] = {}
        for alternative, p in dist.items():
            if p > 0:
                first = self._encode(alternative, sampling)[0][0]
                out[first] = out.get(first, 0.0) + float(p)
        return out

    def _encode(self, action: str, sampling: SamplingConfig) -> tuple[list[int], str]:
        """The token ids a model would have generated to write ``action`` (refused if it could not)."""
        ids = list(self.tokenizer.encode(action, add_special_tokens=False))
        cut = _stop_cut(self.tokenizer, ids, sampling.stop)
        finish = "stop" if cut is not None else "length"
        ids = ids[:cut] if cut is not None else ids
        eos = self.tokenizer.eos_token_id
        allowed = None if sampling.allowed_token_ids is None else set(sampling.allowed_token_ids)
        if (
            cut is None
            and len(ids) < sampling.max_new_tokens
            and (allowed is None or eos in allowed)
        ):
            ids.append(eos)  # a model that wrote this action would end its turn here
            finish = "stop"
        problem = None
        if len(ids) > sampling.max_new_tokens:
            problem = f"is {len(ids)} tokens, more than `sampling.max_new_tokens` = {sampling.max_new_tokens}"
        elif allowed is not None and not set(ids) <= allowed:
            bad = sorted({self.tokenizer.decode([i]) for i in ids if i not in allowed})
            problem = f"uses tokens outside `sampling.allowed_tokens`: {bad}"
        elif not ids:
            problem = "is empty, and eos is not among the tokens the model may generate"
        if problem is not None:
            raise DemonstrationError(
                f"demonstration policy {self.name!r} answered {action!r:.80}, which "
                f"{problem}: the model could never generate it under the recipe's sampling"
            )
        return ids, finish

    def release(self, keys: list[int] | None = None) -> None:
        """Scripted policies keep no cache."""

    def prepare(self, layout: Any, model: Any) -> float:
        return 0.0

    def after_update(self, model: Any) -> None:
        """Nothing to synchronize: the policy has no weights."""

    def metrics(self) -> dict[str, float]:
        return {}


def _stop_cut(tokenizer: Any, ids: list[int], stop: list[str]) -> int | None:
    """The length of the shortest prefix whose text contains a stop string (None: none does)."""
    if not stop:
        return None
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        if any(s in text for s in stop):
            return n
    return None


def policy_seed(episode_seed: int) -> int:
    """The seed of an episode's demonstration policy: a fixed function of the episode seed whose
    random stream is unrelated to one seeded with the episode seed itself."""
    return zlib.crc32(f"demonstration-policy-{episode_seed}".encode())


def play_demonstrations(
    specs: list[EpisodeSpec],
    policy: str,
    policy_kwargs: Mapping[str, Any] | None,
    tokenizer: Any,
    sampling: SamplingConfig,
    **kwargs: Any,
) -> list[Episode]:
    """The episodes of :func:`play_demonstrations_with_targets` (same arguments)."""
    return play_demonstrations_with_targets(
        specs, policy, policy_kwargs, tokenizer, sampling, **kwargs
    )[0]


def play_demonstrations_with_targets(
    specs: list[EpisodeSpec],
    policy: str,
    policy_kwargs: Mapping[str, Any] | None,
    tokenizer: Any,
    sampling: SamplingConfig,
    *,
    arg: str = "--data.policy",
    **rollout_kwargs: Any,
) -> tuple[list[Episode], list[list[dict[int, float] | None]]]:
    """Play ``specs`` with the demonstration policy ``policy`` (a registered name or an import
    path), one instance per episode, seeded from the episode's seed; episodes in spec order, and
    for each episode its turns' first-token targets (:attr:`PolicyBackend.first_token_targets`).
    ``rollout_kwargs`` go to :func:`~earl_lightning.rollout.loop.rollout` (``max_turns``, ...).

    The policy's seed is derived from the episode's, not equal to it: an environment seeds its own
    randomness (a random opponent) with the episode seed, and a policy drawing from an identical
    stream would copy the opponent's moves."""
    policies = {
        s.episode_id: make_policy(policy, policy_kwargs, policy_seed(s.seed), arg) for s in specs
    }
    backend = PolicyBackend(policies, tokenizer, policy)
    episodes = rollout(specs, backend, tokenizer, sampling, **rollout_kwargs)
    return episodes, [backend.first_token_targets.get(ep.spec.episode_id, []) for ep in episodes]
