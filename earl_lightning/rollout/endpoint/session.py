"""A rollout of user agents through the endpoint: every episode's ``agent(client, row, **columns)``
runs on the server's event loop at once, and the trainer's thread generates for their calls in
batches.

The trainer's thread (:func:`agent_rollout`) owns the generation backend: it takes the calls
pending at each moment (:class:`JobQueue`: once every running agent is waiting on a call, or once
no new call has come for ``batch_wait_s``), generates for them in one ``backend.generate`` per
sampling setting, and hands each result back to the event loop. A request's handler records the
call into its episode (:class:`~earl_lightning.rollout.endpoint.record.EpisodeCalls`) and answers.

Faults end one episode, never the rollout: an agent that raises, returns what is not a reward, or
spends more than ``env_timeout_s`` of its own time between two calls (its tools, its code; the
time it waits on the endpoint does not count) fails its episode as an environment fault would
(``error``, counted against ``max_failed_share``). An agent that fails after a call was refused
for the turn or context limit ends its episode as ``truncated`` instead (cut, not broken); one
that handles the refusal and returns its reward ends it as any other.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from earl_lightning.rollout.backends.base import (
    GenerationBackend,
    GenOutput,
    GenRequest,
    SamplingConfig,
)
from earl_lightning.rollout.endpoint.protocol import ApiError, ChatRequest, completion
from earl_lightning.rollout.endpoint.record import CallLimits, EpisodeCalls
from earl_lightning.rollout.endpoint.server import EndpointServer, _unknown_key
from earl_lightning.rollout.types import Episode, EpisodeSpec
from earl_lightning.tasks.deadline import SIGNAL_POLL_S
from earl_lightning.tasks.rows import accepted_kwargs
from earl_lightning.tasks.tool_parsers import ToolParser

AgentFn = Callable[..., Any]
DEFAULT_BATCH_WAIT_S = 0.05
WATCH_EVERY_S = 0.05


@dataclass
class Job:
    """One call waiting for generation."""

    request: GenRequest
    sampling: SamplingConfig
    future: asyncio.Future


class JobQueue:
    """The calls pending for generation, handed from the event loop to the trainer's thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._last = 0.0
        self.running = 0  # agents that have not ended
        self.closed = False

    def put(self, job: Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._last = time.monotonic()
            self._cv.notify_all()

    def agent_ended(self) -> None:
        with self._cv:
            self.running -= 1
            if self.running <= 0:
                self.closed = True
            self._cv.notify_all()

    def take(self, wait_s: float) -> list[Job]:
        """The next batch (empty once every agent has ended): blocks for a first call, then for
        more until every running agent has one pending or none came for ``wait_s``."""
        with self._cv:
            while not self._jobs and not self.closed:
                self._cv.wait(SIGNAL_POLL_S)  # in slices: a ctrl-C is handled meanwhile
            while self._jobs and len(self._jobs) < self.running:
                left = wait_s - (time.monotonic() - self._last)
                if left <= 0:
                    break
                self._cv.wait(left)
            jobs, self._jobs = self._jobs, []
            return jobs


@dataclass
class AgentResult:
    reward: float = 0.0
    info: dict[str, Any] | None = None
    error: str | None = None


class Session:
    """One rollout's episodes behind the endpoint: their API keys, recorded calls and agents."""

    def __init__(
        self,
        server: EndpointServer,
        specs: Sequence[EpisodeSpec],
        tokenizer: Any,
        parser: ToolParser | None,
        limits: CallLimits,
        sampling: SamplingConfig,
    ) -> None:
        self.server, self.sampling, self.tokenizer = server, sampling, tokenizer
        token = secrets.token_hex(8)
        self.keys = [f"earl-{token}-{s.episode_id}" for s in specs]
        self.specs = list(specs)
        self.calls = {
            k: EpisodeCalls(s, tokenizer, parser, limits) for k, s in zip(self.keys, specs)
        }
        self.results: dict[str, AgentResult] = {}
        self.queue = JobQueue()
        self.queue.running = len(specs)
        self.busy_since: dict[str, float | None] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._created = int(time.time())
        self.ignored_sampling: set[str] = set()

    async def handle(self, key: str, request: ChatRequest) -> dict[str, Any]:
        """Answer one call of the episode ``key`` (the server's handler while this session runs)."""
        episode = self.calls.get(key)
        if episode is None:
            raise _unknown_key(key)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # an episode's calls are recorded one after another
            self.busy_since[key] = None
            try:
                gen, budget = episode.prepare(request)
                future = asyncio.get_running_loop().create_future()
                self.queue.put(Job(gen, self._sampling(request, budget), future))
                out: GenOutput = await future
                call_id = f"{gen.key}-{episode.calls}"
                sampled = episode.record(out, request.tool_choice, call_id, request.logprobs)
            finally:
                self.busy_since[key] = time.monotonic()
        return completion(
            f"chatcmpl-{call_id}", request.model, self._created, sampled, request.logprobs
        )

    def _sampling(self, request: ChatRequest, budget: int) -> SamplingConfig:
        """The recipe's sampling with the call's token budget and stop strings. Temperature and
        top_p stay the recipe's: the trainer recomputes log-probs under them, so the policy that
        samples must be the one it trains (a call asking for others is noted once)."""
        for name in ("temperature", "top_p"):
            asked = getattr(request, name)
            if (
                asked is not None
                and not self.sampling.greedy
                and not math.isclose(asked, getattr(self.sampling, name))
            ):
                self.ignored_sampling.add(name)
        stop = list(dict.fromkeys([*self.sampling.stop, *request.stop]))
        return replace(self.sampling, max_new_tokens=budget, stop=stop)


async def _run_agents(session: Session, agent: AgentFn, timeout_s: float | None) -> None:
    """Every episode's agent at once on this loop (a plain ``def`` on a daemon thread of its
    own), each with an OpenAI client keyed to its episode; a watchdog ends an agent that spends
    more than ``timeout_s`` of its own time between two calls."""
    import httpx
    import openai

    is_async = _is_async(agent)
    n = len(session.keys) + 8
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    http = (
        httpx.AsyncClient(limits=limits, timeout=None)
        if is_async
        else httpx.Client(limits=limits, timeout=None)
    )
    make = openai.AsyncOpenAI if is_async else openai.OpenAI
    tasks: dict[str, asyncio.Future] = {}
    try:
        for key, spec in zip(session.keys, session.specs):
            client = make(base_url=session.server.url, api_key=key, max_retries=0, http_client=http)
            session.busy_since[key] = time.monotonic()
            tasks[key] = asyncio.ensure_future(_one(session, key, agent, client, spec, is_async))
        watch = asyncio.ensure_future(_watchdog(session, tasks, timeout_s))
        await asyncio.wait(list(tasks.values()))
        watch.cancel()
    finally:
        if is_async:
            await http.aclose()
        else:
            http.close()


def _is_async(agent: AgentFn) -> bool:
    # an async function, or an object whose __call__ is one
    call = type(agent).__call__ if not inspect.isroutine(agent) else agent
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(call)


def _in_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """``fn()`` on a daemon thread of its own, as a future of this loop: an agent that never
    returns is abandoned there, and never holds the process at exit (a pool's threads would)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(), None
        except BaseException as err:  # noqa: BLE001 - handed to the loop as the agent's failure
            value, exc = None, err
        loop.call_soon_threadsafe(settle, value, exc)

    threading.Thread(target=run, name="earl-agent", daemon=True).start()
    return future


async def _one(
    session: Session, key: str, agent: AgentFn, client: Any, spec: EpisodeSpec, is_async: bool
) -> None:
    row = dict(spec.row or {})
    kwargs = accepted_kwargs(agent, row, skip=("prompt", "client", "row"))
    try:
        if is_async:
            value = await agent(client, row, **kwargs)
        else:
            value = await _in_thread(lambda: agent(client, row, **kwargs))
        session.results.setdefault(key, _result(value))
    except asyncio.CancelledError:
        session.results.setdefault(key, AgentResult(error="the agent was cancelled"))
    except Exception as exc:  # noqa: BLE001 - the agent is the user's: its failure ends its episode
        session.results.setdefault(
            key, AgentResult(error=f"the agent raised {type(exc).__name__}: {exc}")
        )
    finally:
        session.calls[key].finished = True
        session.busy_since[key] = None
        session.queue.agent_ended()


def _result(value: Any) -> AgentResult:
    """An agent's return value: a reward, ``{"reward": ..., "info": {...}}``, or None (the reward
    functions score the episode: ``nan`` until they do)."""
    info: dict[str, Any] = {}
    if isinstance(value, dict):
        info, value = dict(value.get("info") or {}), value.get("reward")
    if value is None:
        return AgentResult(reward=math.nan, info=info)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return AgentResult(
            error=f"the agent returned {value!r} as its reward; an agent returns a finite number, "
            "a dict with 'reward' (and 'info'), or None (the reward functions score the episode)"
        )
    return AgentResult(reward=float(value), info=info)


async def _watchdog(
    session: Session, tasks: dict[str, asyncio.Future], timeout_s: float | None
) -> None:
    if timeout_s is None:
        return
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        now = time.monotonic()
        for key, task in tasks.items():
            since = session.busy_since.get(key)
            if since is not None and not task.done() and now - since > timeout_s:
                session.results.setdefault(
                    key,
                    AgentResult(
                        error=f"the agent spent more than {timeout_s:g} s of its own time between two "
                        "model calls (`--model.rollout.env_timeout_s`)"
                    ),
                )
                session.busy_since[key] = None
                task.cancel()


# ---- the trainer's side -------------------------------------------------------------------------


def agent_rollout(
    specs: list[EpisodeSpec],
    backend: GenerationBackend,
    tokenizer: Any,
    sampling: SamplingConfig,
    *,
    agent: AgentFn,
    server: EndpointServer,
    parser: ToolParser | None,
    max_turns: int,
    max_context_tokens: int,
    env_timeout_s: float | None = None,
    batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
    scored_elsewhere: bool = False,
    max_argument_chars: int | None = None,
) -> list[Episode]:
    """Play every spec's row with ``agent`` through ``server`` (see the module); episodes in spec
    order. Generation happens on this thread; the agents run on the server's event loop.
    ``scored_elsewhere``: reward functions score the episodes, so an agent may return None."""
    limits = CallLimits(max_turns, max_context_tokens, sampling.max_new_tokens, max_argument_chars)
    session = Session(server, specs, tokenizer, parser, limits, sampling)
    server.handler = session.handle
    agents = asyncio.run_coroutine_threadsafe(
        _run_agents(session, agent, env_timeout_s), server.loop
    )
    backend.release(
        None
    )  # a stale cache from an earlier rollout (older weights) must not be reused
    try:
        _generate_until_done(session, backend, batch_wait_s, server.loop)
        agents.result()
    except BaseException:
        agents.cancel()
        raise
    finally:
        server.handler = None
        backend.release(None)
    return [_episode(session, key, scored_elsewhere) for key in session.keys]


def _generate_until_done(
    session: Session, backend: GenerationBackend, wait_s: float, loop: asyncio.AbstractEventLoop
) -> None:
    """Take the pending calls, generate for them (one ``generate`` per sampling setting) and hand
    the results back, until every agent has ended."""
    while jobs := session.queue.take(wait_s):
        by_sampling: dict[str, list[Job]] = {}
        for job in jobs:
            by_sampling.setdefault(repr(job.sampling), []).append(job)
        for group in by_sampling.values():
            try:
                outs = backend.generate([j.request for j in group], group[0].sampling)
            except BaseException as exc:
                for job in jobs:
                    loop.call_soon_threadsafe(
                        _settle,
                        job.future,
                        None,
                        ApiError(500, f"generation failed: {type(exc).__name__}"),
                    )
                raise
            for job, out in zip(group, outs):
                loop.call_soon_threadsafe(_settle, job.future, out, None)


def _settle(future: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if not future.done():
        future.set_exception(exc) if exc is not None else future.set_result(value)


def _episode(session: Session, key: str, scored_elsewhere: bool) -> Episode:
    result = session.results.get(key) or AgentResult(error="the agent did not end")
    if result.error is None and math.isnan(result.reward) and not scored_elsewhere:
        result = AgentResult(
            error="the agent returned no reward, and `--data.reward_funcs` is empty: return a "
            "reward, or name reward functions that score the transcript"
        )
    calls = session.calls[key]
    error, truncated = result.error, False
    if error is not None and calls.refused:
        error, truncated = None, True  # it ended on a call refused at a limit: cut, not broken
    if error is None and not calls.rows:
        error = "the agent made no call to the model"
    reward = None if math.isnan(result.reward) else result.reward
    return calls.to_episode(reward, result.info or {}, error, truncated)
