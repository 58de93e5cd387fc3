"""Scripted demonstration policies: plain callables ``observation -> action text``.

A warm start (``earl sft``) trains the model on transcripts these play in the environment. The
built-ins know the rules, not the strategy:

- ``random_legal``: a uniformly random legal move of a two-player OpenSpiel game (read from the
  observation's ``Legal:`` line);
- ``centre_first``: the first legal column of 3 2 4 1 5 0 6 (Connect Four's scripted baseline);
- ``imperfect_calculator``: a tool user that calls the calculator and answers with its result,
  except for a share ``no_tool_share`` of questions, which it answers at once with a wrong number
  (``protocol``: as the env's, ``tools`` writes a Hermes / Qwen tool call, ``text`` ``calc(expr)``).

A policy may also state what it would play: a ``distribution(observation) -> {action: probability}``
method (``random_legal`` has one). The warm start then trains each turn's first token on that
distribution (``--data.targets expected``) rather than on the one action sampled from it.

A user's own policy is named by import path: a class is a factory (instantiated with ``seed=``
when its constructor takes it, and the ``policy_kwargs``), anything else callable is the policy
itself. Every episode gets its own policy instance, seeded from the episode's seed, so a
demonstration set is a pure function of its seeds.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from earl_lightning.core.checks import check_choice, check_count, check_number
from earl_lightning.core.registry import Registry
from earl_lightning.envs.calculator import CalcError, safe_eval
from earl_lightning.envs.inventory import FIELDS
from earl_lightning.envs.openspiel_env import legal_from_observation, preference_policy

Policy = Callable[[str], str]
PolicyFactory = Callable[..., Policy]


def _as_factory(obj: Any, arg: str) -> PolicyFactory:
    if inspect.isclass(obj):
        return obj
    if not callable(obj):
        raise ValueError(
            f"`{arg}` is {obj!r:.80} (type {type(obj).__name__}), which is not callable; a "
            f"demonstration policy is a callable `observation -> action text` or a class building one"
        )
    return _Fixed(obj)


class _Fixed:
    """A user's plain policy function used as a factory: every episode gets the function itself."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def __call__(self, **kwargs: Any) -> Policy:
        if kwargs:
            raise TypeError(
                f"a plain policy function takes no keyword arguments, got {sorted(kwargs)}"
            )
        return self.policy


DEMONSTRATION_POLICIES: Registry[PolicyFactory] = Registry(
    "demonstration policies", adapt=_as_factory
)


def make_policy(
    name: str, kwargs: Mapping[str, Any] | None, seed: int, arg: str = "--data.policy"
) -> Policy:
    """The policy registered as ``name`` (or at the import path ``name``) for one episode."""
    factory = DEMONSTRATION_POLICIES.get(name, arg)
    given = dict(kwargs or {})
    try:
        params = inspect.signature(factory).parameters
        takes_seed = "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_seed = False
    try:
        policy = factory(
            **({"seed": seed} if takes_seed and not isinstance(factory, _Fixed) else {}), **given
        )
    except TypeError as err:
        raise ValueError(
            f"`{arg}_kwargs` {given!r} do not fit demonstration policy {name!r}: {err}"
        ) from None
    if not callable(policy):
        raise ValueError(
            f"`{arg}` {name!r} built {policy!r:.80}, which is not callable; a demonstration "
            f"policy is a callable `observation -> action text`"
        )
    return policy


def check_policy_name(
    name: str, kwargs: Mapping[str, Any] | None, arg: str = "--data.policy"
) -> None:
    """Config-time check: the name resolves and its kwargs fit (one instance is built and dropped)."""
    make_policy(name, kwargs, 0, arg)


@DEMONSTRATION_POLICIES.register("random_legal")
class RandomLegal:
    """A uniformly random legal move of an OpenSpiel game, from the observation's ``Legal:`` line."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def __call__(self, observation: str) -> str:
        return str(self.rng.choice(self._legal(observation)))

    def distribution(self, observation: str) -> dict[str, float]:
        """Uniform over the legal moves: what the warm start learns with ``--data.targets expected``."""
        legal = self._legal(observation)
        return {str(a): 1.0 / len(legal) for a in legal}

    @staticmethod
    def _legal(observation: str) -> list[int]:
        legal = legal_from_observation(observation)
        if not legal:
            raise ValueError(
                f"random_legal: the observation has no `Legal:` line to choose from: {observation!r:.120}"
            )
        return legal


@DEMONSTRATION_POLICIES.register("centre_first")
def _centre_first(seed: int = 0, order: tuple[int, ...] = (3, 2, 4, 1, 5, 0, 6)) -> Policy:
    """Deterministic: ``seed`` is taken (every policy is given one) and not used."""
    return preference_policy(order)


_QUESTION = re.compile(r"What is (.+?)\?")
_RESULT = re.compile(r"^calc: (\S+)")
_TOOL_RESULT = re.compile(r"^(-?\d+)$")


@DEMONSTRATION_POLICIES.register("imperfect_calculator")
class ImperfectCalculator:
    """The calculator task's imperfect tool user.

    On a question it calls the calculator on the question's expression and then answers with the
    tool's result, except that with probability ``no_tool_share`` it answers at once, without
    the tool, with a wrong number (the right one off by 1 to ``max_error``, each equally likely).
    ``protocol="tools"`` writes the call in the Hermes / Qwen format
    (``<tool_call>{"name": "calculate", ...}</tool_call>``, as ``--model.rollout.tool_parser
    hermes`` reads it) and the answer as the bare number; ``"text"`` writes ``calc(expr)`` and
    ``answer(N)``.

    ``shown_no_tool_share`` (default: ``no_tool_share``) is how often the transcripts show the
    answer without the tool. :meth:`distribution` states the policy's own mix, so with
    ``--data.targets expected`` a turn's first token (tool call or number) is trained on
    ``no_tool_share`` whatever the transcripts show, while the rest of a turn imitates that
    branch's own continuation, which does not depend on how often the branch is shown. A warm
    start can thus show the call written out in most transcripts (a small model needs many to
    learn to copy the expression into it) and still imitate a user who calls it for a quarter of
    the questions.
    """

    def __init__(
        self,
        seed: int = 0,
        no_tool_share: float = 0.5,
        max_error: int = 9,
        protocol: str = "tools",
        shown_no_tool_share: float | None = None,
    ) -> None:
        p = check_number("no_tool_share", no_tool_share, low=0, high=1)
        shown = check_number(
            "shown_no_tool_share", shown_no_tool_share, low=0, high=1, optional=True
        )
        shown = p if shown is None else shown
        if (p == 0 and shown > 0) or (p == 1 and shown < 1):
            raise ValueError(
                f"`shown_no_tool_share` is {shown_no_tool_share!r} but `no_tool_share` is {p:g}: "
                f"the transcripts may only show a branch the policy takes"
            )
        self.max_error = check_count("max_error", max_error)
        self.protocol = check_choice("protocol", protocol, ("tools", "text"))
        self.rng = random.Random(seed)
        self.no_tool_share, self.shown_no_tool_share = p, shown

    def __call__(self, observation: str) -> str:
        branches = self._branches(observation)
        if len(branches) == 1:
            return branches[0][0][0]
        (call, _), _ = branches
        if self.rng.random() < self.shown_no_tool_share:
            error = self.rng.choice([-1, 1]) * self.rng.randint(1, self.max_error)
            return self._answer(str(self._right(observation) + error))
        return call[0]

    def distribution(self, observation: str) -> dict[str, float]:
        """What the policy plays on ``observation``: the call with probability
        ``1 - no_tool_share``, each wrong answer with an equal part of ``no_tool_share``."""
        out: dict[str, float] = {}
        for actions, p in self._branches(observation):
            for action in actions:
                if p > 0:
                    out[action] = out.get(action, 0.0) + p / len(actions)
        return out

    def _branches(self, observation: str) -> list[tuple[list[str], float]]:
        """``[(actions, probability)]``: one certain action, or the call and the wrong answers."""
        result = (_TOOL_RESULT if self.protocol == "tools" else _RESULT).match(observation)
        if result is not None:
            return [([self._answer(result.group(1))], 1.0)]
        question = _QUESTION.search(observation)
        if question is None:  # a calc error or anything unexpected: give up with some answer
            return [([self._answer("0")], 1.0)]
        right = self._right(observation)
        wrong = [
            self._answer(str(right + sign * k))
            for k in range(1, self.max_error + 1)
            for sign in (-1, 1)
        ]
        call = self._call(question.group(1))
        return [([call], 1.0 - self.no_tool_share), (wrong, self.no_tool_share)]

    @staticmethod
    def _right(observation: str) -> int:
        try:
            return int(safe_eval(_QUESTION.search(observation).group(1)))
        except CalcError:
            return 0

    def _call(self, expr: str) -> str:
        if self.protocol == "tools":
            call = json.dumps({"name": "calculate", "arguments": {"expression": expr}})
            return f"<tool_call>\n{call}\n</tool_call>"
        return f"calc({expr})"

    def _answer(self, number: str) -> str:
        return number if self.protocol == "tools" else f"answer({number})"


_ASKS = {"cost": "price", "stock": "stock", "weigh": "weight"}
_ITEM = re.compile(r"(?:one|many) (\w+)")


@DEMONSTRATION_POLICIES.register("imperfect_inventory")
class ImperfectInventory:
    """The inventory task's imperfect tool user: it looks the asked field of the item up with the
    matching tool and answers with what the tool said, except that with probability
    ``wrong_tool_share`` it confuses the tool with its neighbour (price -> stock -> weight ->
    price; ``confusion: neighbour``, the default) or with either other tool (``confusion:
    either``), and so answers a wrong number. A consistent confusion above a share of 0.5 makes
    the wrong tool the imitating model's most likely one: RL has a choice to undo. Calls are
    written in the Hermes / Qwen format, the answer as the bare number."""

    def __init__(
        self, seed: int = 0, wrong_tool_share: float = 0.5, confusion: str = "neighbour"
    ) -> None:
        share = check_number("wrong_tool_share", wrong_tool_share, low=0, high=1)
        self.confusion = check_choice("confusion", confusion, ("neighbour", "either"))
        self.rng, self.wrong_tool_share = random.Random(seed), share

    def __call__(self, observation: str) -> str:
        if re.fullmatch(r"-?\d+", observation.strip()):
            return observation.strip()  # a tool's answer: say it
        asked = next((field for word, field in _ASKS.items() if word in observation), None)
        item = _ITEM.search(observation)
        if asked is None or item is None:
            return "0"  # an error message or anything unexpected: give up with some answer
        tool = asked
        if self.rng.random() < self.wrong_tool_share:
            i = FIELDS.index(asked)
            others = FIELDS[i + 1 :] + FIELDS[:i]  # the neighbour first
            tool = others[0] if self.confusion == "neighbour" else self.rng.choice(others)
        return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': {'item': item.group(1)}})}\n</tool_call>"
