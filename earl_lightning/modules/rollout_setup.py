"""What the rollout loop is called with, read from the typed configuration: the keyword arguments of
:func:`~earl_lightning.rollout.loop.rollout` (one definition, used by the RL step, the warm start's
demonstrations and evaluations), and the checks of a task's first prompt before any work."""

from __future__ import annotations

from typing import Any

from earl_lightning.models import resolve_model_path
from earl_lightning.modules.config import A, RolloutConfig
from earl_lightning.modules.views import backend_spec
from earl_lightning.rollout.backends.registry import GENERATION_BACKENDS


def loop_kwargs(
    rollout: RolloutConfig, tools: Any = None, continuous: bool = False
) -> dict[str, Any]:
    """The keyword arguments of :func:`~earl_lightning.rollout.loop.rollout` these settings give
    (``tools``: a :class:`~earl_lightning.rollout.loop.ToolUse` of the task's tools, or the task's
    tools to pair with ``rollout.tool_parser``)."""
    from earl_lightning.rollout.loop import ToolUse
    from earl_lightning.tasks.tool_parsers import get_tool_parser

    use = tools
    if not isinstance(tools, ToolUse):
        use = (
            ToolUse(
                get_tool_parser(rollout.tool_parser),
                tuple(tools or ()),
                rollout.tool_schema,
                rollout.max_tool_argument_chars,
                rollout.max_tool_result_chars,
            )
            if rollout.tool_parser
            else None
        )
    return dict(
        max_turns=rollout.max_turns,
        max_context_tokens=rollout.max_context_tokens,
        system_prompt=rollout.system_prompt,
        history_turns=rollout.history_turns,
        env_timeout_s=rollout.env_timeout_s,
        call_workers=rollout.call_workers,
        call_isolation=rollout.call_isolation,
        tools=use,
        continuous=continuous and rollout.continuous_turns,
    )


def play_share(
    specs: list[Any],
    backend: Any,
    tokenizer: Any,
    sampling: Any,
    rollout: RolloutConfig,
    layout: Any,
    *,
    tools: Any,
    agent: Any,
    endpoint: Any,
    scored_elsewhere: bool,
) -> list[Any]:
    """This rank's episodes played: by the user's ``agent`` through the ``endpoint``, or by the
    rollout loop (an environment, tools, or a row's single turn)."""
    from earl_lightning.rollout.endpoint import agent_rollout
    from earl_lightning.rollout.loop import rollout as play

    if agent is not None:
        kw = agent_kwargs(rollout, endpoint, layout, scored_elsewhere)
        return agent_rollout(specs, backend, tokenizer, sampling, agent=agent, **kw)
    # tensor-parallel peers generate in lock step: every turn waits for every call
    kwargs = loop_kwargs(rollout, tools, continuous=layout.tp == 1)
    return play(specs, backend, tokenizer, sampling, **kwargs)


def agent_kwargs(
    rollout: RolloutConfig, server: Any, layout: Any, scored_elsewhere: bool
) -> dict[str, Any]:
    """The keyword arguments of :func:`~earl_lightning.rollout.endpoint.session.agent_rollout`
    these settings give: the endpoint ``server`` this rank's agents call, the parser that reads
    calls in the model's format, the turn and context limits, the agents' own time limit."""
    from earl_lightning.tasks.tool_parsers import get_tool_parser

    if layout.tp > 1:
        raise ValueError(
            f"`--data.agent`: the rollout layout {layout} has tp={layout.tp}; agents run on "
            "data-parallel rollout layouts (tp 1: each rank's endpoint serves its own episodes). "
            "Give the rollout stage a layout with tp 1"
        )
    return dict(
        server=server,
        parser=get_tool_parser(rollout.tool_parser) if rollout.tool_parser else None,
        max_turns=rollout.max_turns,
        max_context_tokens=rollout.max_context_tokens,
        env_timeout_s=rollout.env_timeout_s,
        scored_elsewhere=scored_elsewhere,
        max_argument_chars=rollout.max_tool_argument_chars,
    )


def check_first_observation(
    rollout: RolloutConfig, tokenizer: Any, spec: Any, tools: Any = ()
) -> None:
    """``max_context_tokens`` smaller than the first prompt (an env's first observation, or the
    first dataset row's prompt, with the tools rendered) fails before any work is done; so does an
    env whose reset fails, tools without a parser to read their calls, and tools that cannot be
    sent to a worker process under ``call_isolation: process``."""
    from earl_lightning.rollout.env_calls import EnvFault
    from earl_lightning.rollout.loop import first_prompt_ids
    from earl_lightning.rollout.process_env import check_picklable

    if tools and rollout.tool_parser is None:
        raise ValueError(
            f"`--data.tools` names tools {[t.name for t in tools]}, and `{A}.rollout.tool_parser` is null: "
            f"set the parser of the model's tool-call format (hermes, llama3_json, mistral)"
        )
    if tools and rollout.call_isolation == "process":
        check_picklable(tools)
    try:
        ids = first_prompt_ids(
            spec, tokenizer, rollout.system_prompt, loop_kwargs(rollout, tools)["tools"]
        )
    except EnvFault as fault:
        where = fault.where()
        raise ValueError(
            f"`--data.env` {spec.env!r}: {fault}{f' (at {where})' if where else ''}"
        ) from None
    need = len(ids) + rollout.sampling.max_new_tokens
    if need > rollout.max_context_tokens:
        what = (
            f"the first row's prompt (row {spec.row_index})"
            if spec.row is not None
            else f"the first observation of env {spec.env!r}"
        )
        raise ValueError(
            f"`{A}.rollout.max_context_tokens` ({rollout.max_context_tokens}) is smaller than {what} "
            f"plus one turn: {len(ids)} prompt tokens + {rollout.sampling.max_new_tokens} new tokens = "
            f"{need}; raise it to at least {need}"
        )


def make_backend(
    model: str,
    dtype: str,
    seed: int,
    rollout: RolloutConfig,
    local_rank: int,
    policy: Any,
    tokenizer: Any,
) -> Any:
    """The generation backend ``--model.rollout.backend`` names, bound to ``policy`` (the rollout
    stage's copy) and made from the module's settings (:func:`backend_spec`)."""
    spec = backend_spec(
        resolve_model_path(model, "--model.model"), dtype, seed, rollout, local_rank
    )
    factory = GENERATION_BACKENDS.get(rollout.backend, "--model.rollout.backend")
    return factory(policy, tokenizer, spec)


def reward_extras(trainer: Any) -> dict[str, Any]:
    """What reward functions may read besides the completions: TRL's ``trainer_state`` (a
    transformers ``TrainerState`` with the step, the planned steps and the epoch)."""
    from transformers import TrainerState

    return {
        "trainer_state": TrainerState(
            global_step=trainer.global_step,
            max_steps=max(trainer.max_steps, 0),
            epoch=float(trainer.current_epoch),
        )
    }
