"""The typed configuration groups of :class:`~earl_lightning.modules.rl.AgenticRLModule`.

Each group is a frozen dataclass that validates itself on construction, with errors spelled the
way a recipe or the command line writes the setting (``--model.algorithm.loss.clip_high``).
LightningCLI reads the signatures and docstrings: every field is a nested flag
(``--model.optim.lr 5e-4``) and ``--print_config`` shows the whole tree. A plain dict is accepted
wherever a group is (Python users, checkpoints' saved hyperparameters).

Estimators and losses are named by registry name or import path; their parameter fields default
to None, meaning "the registered function's own default", and a parameter the chosen function
does not take is a configuration error.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Literal

from earl_lightning.algorithms.estimators import AdvantageEstimator, get_advantage_estimator
from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.core.config_groups import coerce
from earl_lightning.core.registry import bind_params, param_default
from earl_lightning.modules.algorithm_groups import (  # noqa: F401 - public here too
    DynamicSamplingConfig,
    KLConfig,
    LossConfig,
    OverlongConfig,
    RolloutCorrectionConfig,
    ValueConfig,
)
from earl_lightning.rollout.backends.base import SamplingConfig, SamplingFields
from earl_lightning.rollout.backends.registry import GENERATION_BACKENDS
from earl_lightning.rollout.loop import check_history_turns

A = "--model"


def _coerce_nested(group: Any, arg: str) -> None:
    """Nested groups given as dicts become their dataclasses (the group is frozen: set through object)."""
    hints = typing.get_type_hints(type(group))
    for f in fields(group):
        kind = hints[f.name]
        if is_dataclass(kind) and not isinstance(getattr(group, f.name), kind):
            object.__setattr__(
                group, f.name, coerce(kind, getattr(group, f.name), f"{arg}.{f.name}")
            )


@dataclass(frozen=True)
class SamplingOptions(SamplingFields):
    """How every assistant turn is sampled.

    Args:
        max_new_tokens: tokens generated per turn at most.
        temperature: softmax temperature (also applied to the trainer's recomputed log-probs).
        top_p: nucleus sampling mass (1.0 disables).
        top_k: keep the k most likely tokens (0 disables).
        stop: strings that end a turn as soon as the generated text contains one.
        allowed_tokens: restrict every generated token to these strings, each exactly one token
            of the tokenizer (e.g. a board game's column digits). The policy is then the softmax
            over those tokens' logits, in the rollout and in the trainer alike. null: the whole
            vocabulary.
    """

    allowed_tokens: list[str] | None = None

    _arg: ClassVar[str] = f"{A}.rollout.sampling"

    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.allowed_tokens
        if t is not None and (
            isinstance(t, str)
            or not isinstance(t, (list, tuple))
            or not t
            or not all(isinstance(x, str) and x for x in t)
        ):
            raise ValueError(
                f"`{self._arg}.allowed_tokens` must be a non-empty list of non-empty strings such as "
                f"['0', '1', '2'], got {t!r}"
            )

    def request(
        self, allowed_token_ids: list[int] | None, *, greedy: bool = False, seed: int | None = None
    ) -> SamplingConfig:
        """A backend's request for these settings: the allowed tokens as ids
        (:meth:`token_ids`), greedy or sampled, seeded or not."""
        return SamplingConfig(
            **self.sampling_fields(), greedy=greedy, seed=seed, allowed_token_ids=allowed_token_ids
        )

    def token_ids(self, tokenizer: Any) -> list[int] | None:
        """The ids of :attr:`allowed_tokens` under ``tokenizer`` (None when unset)."""
        if self.allowed_tokens is None:
            return None
        arg = f"{A}.rollout.sampling.allowed_tokens"
        ids = []
        for t in self.allowed_tokens:
            enc = tokenizer.encode(t, add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(
                    f"`{arg}` entry {t!r} is {len(enc)} tokens {enc} for this tokenizer; each entry "
                    f"must be exactly one token"
                )
            ids.append(int(enc[0]))
        dup = sorted({t for t, i in zip(self.allowed_tokens, ids) if ids.count(i) > 1})
        if dup:
            raise ValueError(f"`{arg}` entries {dup} map to the same token; list each token once")
        return ids


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are played.

    Args:
        backend: generation backend: ``hf`` (transformers, KV cache reused across turns),
            ``vllm`` (a colocated vLLM engine), or a user's: a name registered with
            ``GENERATION_BACKENDS.register`` or the import path of a backend factory.
        reuse_kv: ``hf`` only; false re-encodes the whole context every turn (reference path).
        share_prompts: ``hf`` only; a prompt that several episodes of one generation call start
            from (a group's first turn) is encoded once; false encodes it per episode.
        max_turns: turns per episode before it is truncated.
        max_context_tokens: an episode ends (truncated) when its next turn would exceed this.
        history_turns: null: every turn sees the whole chat and the episode trains as one row.
            ``k >= 0``: each turn sees [system] + the last ``k`` exchanges + the current
            observation (0: the observation alone) and trains as its own row, whose last token
            carries the turn's reward plus the discounted return of the turns after it.
        system_prompt: optional system message before the first observation.
        sampling: how each turn is sampled.
        env_timeout_s: building the env, ``reset()`` or ``step()`` taking longer ends that episode
            as failed (``env/errors``; the env is abandoned); a tool call taking longer returns an
            error message to the model; null: no limit.
        max_failed_share: the run stops with a clear error when at least this share of one RL
            step's episodes failed inside the environment (1.0: only when all of them did).
        tool_parser: how the model writes tool calls: ``hermes`` (Hermes, Qwen2.5, Qwen3 and the
            offline tiny models), ``llama3_json``, ``mistral``, or an import path; null: no turn is
            read as a tool call (then the task may offer no tools).
        tool_schema: how every prompt renders the tools' schemas: ``full``, or ``compact``:
            without each parameter's description and the return value's entry (the tool's name,
            description, parameters' names, types and which are required stay). A template that
            renders whole schemas costs fewer tokens then (the calculator's prompt with
            ``earl-tiny-bpe-4l``: 154 tokens instead of 199); the warm start must use the same.
        max_tool_argument_chars: a tool call whose arguments, written as JSON, are longer than this
            (in characters) is not run: the model reads an error message instead; null: no cap.
            (Arguments nested deeper than 32 levels, or that are not plain JSON data, are refused
            the same way whatever this is.)
        max_tool_result_chars: each tool result (and error message) is cut to this many characters
            before it is tokenized, and ``[... truncated N characters]`` added, so the model knows
            (``tools/truncated`` counts them); null: whole results.
        reward_timeout_s: a reward function still running this long after it was handed a batch
            of rows loses the rows it has not scored, as if it had raised (``rewards/errors``);
            where it was is logged once. A plain function stays on the main thread (math-verify's
            own alarms need it) and is interrupted there, in a sleep, a wait or a Python loop (not
            inside C code that never returns); off the main thread it runs on a daemon thread of
            its own and is abandoned, then not called again until that call returns. An ``async``
            one is cancelled. null: no limit.
        call_workers: threads running the env steps and tool calls of all live episodes at once
            (1: one at a time). Calls that only compute run on the rollout's own thread instead,
            limited by ``env_timeout_s`` there (a thread gains them nothing under the GIL and
            costs tens of microseconds a call); a kind of call seen waiting (a server, a sleep, an
            ``async`` env: three of its calls, and half of them, mostly off the CPU, or one
            hang) runs on these threads for the rest of the process.
        call_isolation: ``thread``: environments and tools live in the trainer's process;
            ``process``: in a pool of ``min(call_workers, CPUs)`` worker processes, started once
            per trainer process and reused, each episode pinned to one; a call past
            ``env_timeout_s`` kills its worker (even one holding the GIL): only its episode is
            lost, the others there are rebuilt in a fresh worker by replaying their calls.
        continuous_turns: an episode whose calls have returned is generated for at once, without
            waiting for the other episodes' calls (tensor-parallel rollouts always wait: their
            ranks must generate the same batches). Off by default: the batches then depend on
            when calls return, and a forward pass's last bits on its batch's size and padding, so
            a run is no longer bit-reproducible (nor its resume exact); false: every turn waits
            for every call.
    """

    # a name of GENERATION_BACKENDS (a user's registers there) or an import path, checked there
    backend: str = "hf"
    reuse_kv: bool = True
    share_prompts: bool = True
    max_turns: int = 32
    max_context_tokens: int = 4096
    history_turns: int | None = None
    system_prompt: str | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    env_timeout_s: float | None = 120.0
    max_failed_share: float = 1.0
    tool_parser: str | None = None
    tool_schema: Literal["full", "compact"] = "full"
    max_tool_argument_chars: int | None = 32768
    max_tool_result_chars: int | None = 32768
    reward_timeout_s: float | None = 300.0
    call_workers: int = 64
    call_isolation: Literal["thread", "process"] = "thread"
    continuous_turns: bool = False

    def __post_init__(self) -> None:
        arg = f"{A}.rollout"
        _coerce_nested(self, arg)
        GENERATION_BACKENDS.get(self.backend, f"{arg}.backend")  # lists the registered names
        if self.backend == "vllm":
            from earl_lightning.rollout.backends.vllm_support import (
                vllm_available,
                vllm_install_hint,
            )

            if not vllm_available():
                raise ImportError(
                    f"`{arg}.backend vllm` needs vLLM, which is not installed; install it "
                    f"with: {vllm_install_hint()}"
                )
        check_count(f"{arg}.max_turns", self.max_turns)
        check_count(f"{arg}.max_context_tokens", self.max_context_tokens)
        check_history_turns(self.history_turns, f"{arg}.history_turns")
        check_number(f"{arg}.env_timeout_s", self.env_timeout_s, low=0, strict=True, optional=True)
        for name in ("max_tool_argument_chars", "max_tool_result_chars"):
            check_count(f"{arg}.{name}", getattr(self, name), optional=True)
        check_number(
            f"{arg}.reward_timeout_s", self.reward_timeout_s, low=0, strict=True, optional=True
        )
        check_count(f"{arg}.call_workers", self.call_workers)
        check_choice(f"{arg}.call_isolation", self.call_isolation, ("thread", "process"))
        check_choice(f"{arg}.tool_schema", self.tool_schema, ("full", "compact"))
        if self.tool_parser is not None:
            from earl_lightning.tasks.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_parser, f"{arg}.tool_parser")
        check_number(f"{arg}.max_failed_share", self.max_failed_share, low=0, high=1, strict=True)


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage estimator.

    Args:
        name: registered name (``grpo``, ``rloo``, ``reinforce_pp``, ``gae``, ``gigpo``) or import
            path of a function registered with ``register_advantage_estimator``. ``gae`` adds a value
            head; ``gigpo`` (GRPO + a step-level advantage per state) needs ``rollout.history_turns``.
        gamma: discount over generated tokens (reinforce_pp, gae); null: the estimator's default.
        lam: GAE lambda (gae); null: the estimator's default.
        scale: GRPO's advantage scale: ``group`` std, ``batch`` std or ``none`` (Dr. GRPO).
        kwargs: further keyword parameters of a user's estimator.
    """

    name: str = "grpo"
    gamma: float | None = None
    lam: float | None = None
    scale: Literal["group", "batch", "none"] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arg = f"{A}.algorithm.advantage"
        check_number(f"{arg}.gamma", self.gamma, low=0, high=1, optional=True)
        check_number(f"{arg}.lam", self.lam, low=0, high=1, optional=True)
        check_choice(f"{arg}.scale", self.scale, (None, "group", "batch", "none"))
        self.params  # noqa: B018 - resolves the estimator and binds its parameters now, at config time

    @property
    def estimator(self) -> AdvantageEstimator:
        """The estimator that ``name`` selects, with what it needs from the trainer (values,
        state keys)."""
        return get_advantage_estimator(self.name, f"{A}.algorithm.advantage.name")

    @property
    def params(self) -> dict[str, Any]:
        """The keyword parameters the estimator is called with (checked against its signature)."""
        given = {"gamma": self.gamma, "lam": self.lam, "scale": self.scale, **self.kwargs}
        return bind_params(
            self.estimator.fn,
            given,
            what=f"advantage estimator {self.name!r}",
            arg=f"{A}.algorithm.advantage",
            skip=2,
        )

    def effective(self, name: str, fallback: Any) -> Any:
        """The value the estimator sees for ``name`` (given, else its default, else ``fallback``)."""
        return param_default(self.estimator.fn, name, self.params, fallback)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL algorithm: advantages, policy loss, KL, entropy bonus, value head, and the peers'
    additions (rollout correction, truncated rows, overlong shaping, dynamic sampling).

    GRPO is ``advantage.name: grpo``; REINFORCE++ ``reinforce_pp``; PPO ``gae`` (with a value head).

    Args:
        advantage: the advantage estimator and its parameters.
        loss: the policy loss, its parameters and the aggregation.
        kl: KL to the reference model.
        entropy_coef: entropy bonus weight.
        value: the value head's loss.
        rollout_correction: importance weights between the backend's sampled log-probs and the
            trainer's (truncated or masked importance sampling).
        mask_truncated: the rows of an episode cut by ``rollout.max_turns``,
            ``rollout.max_context_tokens`` or (a row played without an environment)
            ``rollout.sampling.max_new_tokens`` leave the loss; they still count in their group's
            advantages (TRL's ``mask_truncated_completions``).
        overlong: DAPO's soft overlong punishment of long episodes (training rewards only).
        dynamic_sampling: DAPO's dynamic sampling: zero-spread groups dropped and more drawn.
    """

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    value: ValueConfig = field(default_factory=ValueConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    mask_truncated: bool = False
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def __post_init__(self) -> None:
        _coerce_nested(self, f"{A}.algorithm")
        check_number(f"{A}.algorithm.entropy_coef", self.entropy_coef, low=0)

    @property
    def needs_values(self) -> bool:
        """Whether the advantage estimator reads values, so the module builds and trains a value
        head."""
        return self.advantage.estimator.needs_values


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, its schedule, and how each RL batch is cut into optimizer steps.

    Args:
        lr: learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up, in optimizer steps.
        lr_schedule: after warm-up: ``constant``, ``cosine`` or ``linear`` decay to 0 at ``max_steps``.
        max_grad_norm: clip the global gradient norm (0 disables).
        ppo_epochs: passes over each RL batch.
        mini_batches: optimizer steps per pass.
        micro_batch_tokens: padded-token budget of one forward/backward (gradient accumulation).
        on_policy_shortcut: when the update is exactly on-policy (one epoch and mini-batch, hf backend,
            no value head, no KL in the reward), skip the old log-probs' forward and use the training
            forward's own, detached (the ratio is exactly 1, as in TRL); false always recomputes them.
        share_prefix: a prompt several sequences of a micro-batch begin with runs once, from its KV
            cache (``train/prefix.py``: when it saves >= 25% of the tokens); false runs whole sequences.
        scored_last_layer: the policy forwards' last layer runs only where an action token is scored
            (``train/scored.py``: Llama-pattern models; same loss and gradients); false: everywhere.
        causal_chunks: on CPU, the policy forwards' causal attention over 384 to 767 positions runs in
            query chunks of at least 192, each over the keys it sees (``train/causal_chunks.py``: the
            CPU kernel computes fewer masked pairs; same numbers up to float rounding); false: one call.
        rms_norm_backward: in fp32, the policy's Llama-pattern RMSNorms run a written-out backward
            (``train/rms_norm.py``: the same forward bit for bit, gradients up to float rounding, the
            backward in 0.5–0.7 of the time); false: autograd's.
        fused_elementwise: on CPU, where a train forward's activations are large (a million values
            and more), the policy's Llama-pattern MLPs' ``silu(gate) * up``, RMSNorms and rotary
            embedding run as kernels ``torch.compile`` fuses, forward and backward
            (``train/fused.py``: compiled once per process, at the first call that qualifies, in
            seconds; the same numbers up to float rounding; eager where compiling fails, with a
            warning); false: the modules' own operators.
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batch_tokens: int = 16384
    on_policy_shortcut: bool = True
    share_prefix: bool = True
    scored_last_layer: bool = True
    causal_chunks: bool = True
    rms_norm_backward: bool = True
    fused_elementwise: bool = True

    def __post_init__(self) -> None:
        arg = f"{A}.optim"
        check_number(f"{arg}.lr", self.lr, low=0, strict=True)
        check_number(f"{arg}.weight_decay", self.weight_decay, low=0)
        check_number(f"{arg}.max_grad_norm", self.max_grad_norm, low=0)
        check_count(f"{arg}.warmup_steps", self.warmup_steps, low=0)
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(
                f"unknown `{arg}.lr_schedule` {self.lr_schedule!r}; valid: ['constant', 'cosine', 'linear']"
            )
        for name in ("ppo_epochs", "mini_batches", "micro_batch_tokens"):
            check_count(f"{arg}.{name}", getattr(self, name))

    def lr_factor(self, step: int, total: int) -> float:
        """The learning rate's multiplier at optimizer step ``step`` of ``total``."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        frac = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        if self.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * frac))
        if self.lr_schedule == "linear":
            return 1.0 - frac
        return 1.0


def check_combination(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """Settings that are valid alone but not together."""
    h = rollout.history_turns
    if h is None:
        if algorithm.advantage.estimator.needs_state_keys:
            raise ValueError(
                f"`{A}.algorithm.advantage.name` {algorithm.advantage.name!r} compares turns taken in the "
                f"same state, so each turn must be its own row: set `{A}.rollout.history_turns` (e.g. 0)"
            )
        return
    lam = algorithm.advantage.effective("lam", 1.0)
    if lam != 1.0:
        raise ValueError(
            f"`{A}.algorithm.advantage.lam` must be 1.0 with `{A}.rollout.history_turns` ({h}), got "
            f"{lam!r}: each turn is its own row, and GAE with lam < 1 would need the value of the next "
            f"turn's row; leave `history_turns` unset (null) for lam < 1"
        )
    if algorithm.kl.coef and algorithm.kl.in_reward:
        raise ValueError(
            f"`{A}.algorithm.kl.in_reward` true is not supported with `{A}.rollout.history_turns` "
            f"({h}): a later turn row's KL penalty would not reach the earlier rows' returns; use the "
            f"KL as a loss term (in_reward false)"
        )


def check_dtype_and_seed(dtype: str, seed: int) -> None:
    """The ``--model.dtype`` and ``--model.seed`` checks that the RL and the warm-start modules
    share (ValueError naming the argument)."""
    from earl_lightning.models import resolve_dtype

    resolve_dtype(dtype, f"{A}.dtype")
    check_count(f"{A}.seed", seed, low=0)


def check_module_args(
    dtype: str, seed: int, no_signal_steps: int, logprob_mismatch_warn: float
) -> None:
    """The RL module's plain arguments checked at construction, each error naming its
    ``--model.*`` argument (the typed groups check themselves)."""
    check_dtype_and_seed(dtype, seed)
    check_count(f"{A}.no_signal_steps", no_signal_steps, low=0)
    check_number(f"{A}.logprob_mismatch_warn", logprob_mismatch_warn, low=0, strict=True)
