"""The generation-backend protocol shared by the HF and vLLM backends, and its request types."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol, runtime_checkable

from earl_lightning.core.checks import check_count, check_number, is_int


@dataclass(frozen=True)
class SamplingFields:
    """The sampling settings a user writes, each defined and defaulted once: the recipe's group
    (``--model.rollout.sampling``, :class:`~earl_lightning.modules.config.SamplingOptions`) and a
    backend's request (:class:`SamplingConfig`) both extend it. Validated on construction; errors
    name the settings as ``{_arg}.<setting>``."""

    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)

    _arg: ClassVar[str] = "sampling"

    def __post_init__(self) -> None:
        temperature = self._checked_temperature()
        check_sampling(
            self.max_new_tokens, temperature, self.top_p, self.top_k, self.stop, arg=self._arg
        )

    def _checked_temperature(self) -> float:
        return self.temperature

    def sampling_fields(self) -> dict[str, Any]:
        """The shared settings as keyword arguments (``stop`` copied)."""
        return {f.name: getattr(self, f.name) for f in fields(SamplingFields)} | {
            "stop": list(self.stop)
        }


@dataclass(frozen=True)
class SamplingConfig(SamplingFields):
    """How to sample one assistant turn: the user's settings (:class:`SamplingFields`) plus what
    the trainer decides per call. Validated on construction.

    ``stop`` strings end a turn as soon as the decoded generated text contains one (the tokens
    are kept, finish reason ``"stop"``); the eos token always stops. ``greedy`` takes the argmax
    (temperature, top-k and top-p are then ignored). ``allowed_token_ids`` restricts every
    generated token to that set (vLLM's ``allowed_token_ids``): the policy becomes the softmax over
    those tokens' logits, and the returned log-probs are under it; eos ends a turn early only if it
    is in the set. ``seed`` makes sampling reproducible: ranks of one tensor-parallel group pass the
    same seed and draw the same tokens.
    """

    greedy: bool = False
    seed: int | None = None
    allowed_token_ids: list[int] | None = None

    def _checked_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature  # greedy decoding ignores the temperature

    def __post_init__(self) -> None:
        super().__post_init__()
        ids = self.allowed_token_ids
        if ids is not None and (
            isinstance(ids, (str, bytes))
            or not ids
            or len(set(ids)) != len(ids)
            or not all(is_int(i) and i >= 0 for i in ids)
        ):
            raise ValueError(
                f"`sampling.allowed_token_ids` must be None or a non-empty list of distinct token ids "
                f"(integers >= 0), got {ids!r}"
            )
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"`sampling.seed` must be an integer or None, got {self.seed!r}")


def check_sampling(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop: list[str],
    *,
    arg: str = "sampling",
) -> None:
    """The sampling settings a user writes; errors name them as ``{arg}.<setting>``."""
    check_count(f"{arg}.max_new_tokens", max_new_tokens)
    check_number(
        f"{arg}.temperature",
        temperature,
        low=0,
        strict=True,
        unit=" (or set `sampling.greedy` for argmax decoding)",
    )
    check_number(f"{arg}.top_p", top_p, low=0, high=1, strict=True)
    check_count(f"{arg}.top_k", top_k, low=0, unit=" (0 = no top-k)")
    if (
        isinstance(stop, str)
        or not isinstance(stop, (list, tuple))
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ValueError(f"`{arg}.stop` must be a list of non-empty strings, got {stop!r}")


@dataclass
class GenRequest:
    """One episode's generation request.

    ``key`` identifies the episode across its turns (stable for the whole rollout); ``prompt_ids``
    is the WHOLE context so far, ending with the assistant generation prompt. ``observation`` is
    the text of the last user message (what a scripted policy answers; model backends ignore it).
    """

    key: int
    prompt_ids: list[int]
    observation: str | None = None


@dataclass
class GenOutput:
    """The generated tokens (eos included when sampled), the log-prob of each under
    softmax(logits / temperature) before top-k / top-p filtering (0.0 when greedy), and why
    generation stopped: ``"stop"`` (eos or a stop string) or ``"length"``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@runtime_checkable
class GenerationBackend(Protocol):
    """Generates one assistant turn for a batch of episodes, for the trainer's current weights.

    A backend may reuse any state it cached for a request key whose previous context is a prefix
    of the new ``prompt_ids`` (HF: the KV cache; vLLM: prefix caching). ``release`` drops cached
    state (``None`` = all keys); the rollout loop releases keys when an episode ends.

    The trainer drives it through one RL iteration: ``prepare(layout, model)`` before a rollout
    (bind the stage's model placed for ``layout``; vLLM: an engine of ``layout.tp``, awake, with
    current weights; returns the seconds spent switching), ``generate`` / ``release`` during it,
    ``after_update(model)`` after the optimizer step (the weights changed: drop caches, push
    weights, sleep), and ``metrics()`` for the step's log.
    """

    def generate(self, requests: list[GenRequest], sampling: SamplingConfig) -> list[GenOutput]: ...

    def release(self, keys: list[int] | None = None) -> None: ...

    def prepare(self, layout: Any, model: Any) -> float: ...

    def after_update(self, model: Any) -> None: ...

    def metrics(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class BackendSpec:
    """What a backend factory needs besides the model and tokenizer: the model's path (an engine
    loads it), dtype, seed, longest context, the HF backend's KV reuse, and this process's rank on
    its node (an engine's device). ``share_prompts``: the HF backend encodes a prompt several
    episodes of one call share once. A view of the module's settings and its rollout group, made
    by :func:`earl_lightning.modules.views.backend_spec`; no defaults of its own."""

    model_path: str
    dtype: str
    seed: int
    max_context_tokens: int
    reuse_kv: bool
    share_prompts: bool
    local_rank: int


def check_requests(requests: list[GenRequest]) -> None:
    """What every backend needs of a generate call: unique keys (they name KV/prefix state) and
    non-empty prompts."""
    keys = [r.key for r in requests]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(
            f"`requests` keys must be unique within one generate call; duplicated: {dup[:8]}"
        )
    for r in requests:
        if not r.prompt_ids:
            raise ValueError(
                f"`requests` key {r.key}: `prompt_ids` is empty; it must hold at least one token"
            )
