"""Reward functions with TRL's signature: resolution and signature checks at config time, calls
with the rows' columns, async ones awaited together, and what a broken function costs (only the
rows it cannot score); a hung one costs its rows at its time limit, and one thread."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from earl_lightning.tasks.rewards import call_reward_funcs, check_columns, resolve_reward_funcs
from tests.plugins import rewards as rewards_plugin

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "6"]
IDS = [[1], [2], [3]]
COLUMNS = {"answer": ["2", "4", "6"], "level": [0, 1, 2]}


def _call(funcs, weights=None, **extras):
    return call_reward_funcs(
        resolve_reward_funcs(funcs, weights), PROMPTS, COMPLETIONS, IDS, COLUMNS, extras
    )


def test_trl_signature_gets_columns_by_keyword_and_none_means_not_applicable():
    seen = {}

    def exact(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(kwargs, prompts=prompts, ids=completion_ids)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    def odd_level(completions, level):  # no **kwargs: gets only the names it takes
        return [0.5 if lv % 2 else None for lv in level]

    (a, b) = _call([exact, odd_level], trainer_state="state")
    assert a.values == [1.0, 0.0, 1.0] and a.errors == [None] * 3
    assert b.values == [None, 0.5, None]
    assert seen["level"] == [0, 1, 2] and seen["prompts"] == PROMPTS and seen["ids"] == IDS
    assert (
        seen["trainer_state"] == "state"
        and callable(seen["log_metric"])
        and callable(seen["log_extra"])
    )


def test_names_weights_and_import_paths():
    funcs = resolve_reward_funcs(
        ["tests.plugins.rewards.exact_sum", "tests.plugins.rewards.exact_sum"], [1.0, 0.5]
    )
    assert [f.name for f in funcs] == ["exact_sum", "exact_sum_2"] and [
        f.weight for f in funcs
    ] == [1.0, 0.5]
    assert resolve_reward_funcs([lambda completions, **kw: []], None)[0].weight == 1.0


def test_async_functions_are_awaited_together():
    """Each of the two waits for the other: they finish only when they run at the same time."""
    first, second = asyncio.Event(), asyncio.Event()

    async def a(completions, **kw):
        first.set()
        await asyncio.wait_for(second.wait(), 10)
        return [1.0] * len(completions)

    async def b(completions, **kw):
        second.set()
        await asyncio.wait_for(first.wait(), 10)
        return [2.0] * len(completions)

    out = _call([a, b])
    assert [o.values for o in out] == [[1.0] * 3, [2.0] * 3]


def test_a_function_that_raises_loses_only_the_rows_it_cannot_score():
    def picky(completions, **kw):
        if len(completions) > 1:
            raise ValueError("batch")
        if completions[0] == "5":
            raise KeyError("five")
        return [1.0]

    async def picky_async(completions, **kw):
        return picky(completions)

    for fn in (picky, picky_async):
        (out,) = _call([fn])
        assert out.values == [1.0, None, 1.0]
        assert out.errors[0] is None and out.errors[2] is None
        assert out.errors[1] == f"reward function {fn.__name__!r} raised KeyError: 'five'"


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], "returned 1 values for 3 completions; it must return one per completion"),
        ("abc", "returned str 'abc'; it must return a list of 3 floats or None"),
        (
            [1.0, "x", 2.0],
            "returned 'x' (str) among its values; each must be a finite number, or None",
        ),
        ([1.0, math.inf, 2.0], "returned inf (float) among its values"),
    ],
)
def test_a_wrong_return_loses_the_whole_batch_with_the_function_named(returned, message):
    def bad(completions, **kw):
        return returned

    (out,) = _call([bad])
    assert out.values == [None] * 3
    assert all(e.startswith(f"reward function 'bad' {message}") for e in out.errors)


def test_nan_numpy_and_torch_values():
    import numpy as np
    import torch

    def mixed(completions, **kw):
        return [float("nan"), np.float32(0.5), torch.tensor(2.0)]

    (out,) = _call([mixed])
    assert out.values == [None, 0.5, 2.0]


def test_log_metric_and_log_extra_are_collected():
    def logs(completions, log_metric, log_extra, **kw):
        log_metric("parsed", 0.75)
        log_extra("why", ["a", "b", "c"])
        return [0.0] * len(completions)

    (out,) = _call([logs])
    assert out.metrics == {"parsed": [0.75]} and out.extra == {"why": ["a", "b", "c"]}


def test_trls_own_accuracy_reward_runs_unchanged():
    from trl.rewards import accuracy_reward

    funcs = resolve_reward_funcs(["trl.rewards.accuracy_reward"], None)
    completions = [
        [{"role": "assistant", "content": r"\boxed{2}"}],
        [{"role": "assistant", "content": "4"}],
    ]
    (out,) = call_reward_funcs(
        funcs,
        [[{"role": "user", "content": "1+1"}]] * 2,
        completions,
        [[1], [2]],
        {"solution": ["2", "4"]},
    )
    assert funcs[0].fn is accuracy_reward and out.values == [1.0, 0.0]


@pytest.mark.parametrize(
    "funcs, weights, message",
    [
        (
            ["tests.plugins.rewards.NOT_CALLABLE"],
            None,
            r"`--data.reward_funcs\[0\]` 'tests.plugins.rewards.NOT_CALLABLE' "
            r"is int 3, not callable",
        ),
        (
            ["tests.plugins.rewards.nope"],
            None,
            r"`--data.reward_funcs\[0\]` 'tests.plugins.rewards.nope': module "
            r"'tests.plugins.rewards' has no attribute 'nope'",
        ),
        (
            ["no_such_package.f"],
            None,
            r"`--data.reward_funcs\[0\]` 'no_such_package.f': cannot import module",
        ),
        (
            ["tests.plugins.rewards.no_completions"],
            None,
            r"takes no `completions`; a reward function is fn\(prompts, "
            r"completions, completion_ids, \*\*columns\)",
        ),
        (
            ["tests.plugins.rewards.exact_sum"],
            [1.0, 2.0],
            r"`--data.reward_weights` has 2 weights for 1 reward functions",
        ),
        (
            ["tests.plugins.rewards.exact_sum"],
            ["x"],
            r"`--data.reward_weights` must be a list of finite numbers",
        ),
    ],
)
def test_bad_reward_functions_are_one_line(funcs, weights, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward_funcs(funcs, weights)


def test_a_positional_only_function_is_refused():
    def f(completions, /, **kw):
        return []

    with pytest.raises(ValueError, match=r"takes \['completions'\] positionally only"):
        resolve_reward_funcs([f], None)


def test_a_required_column_the_rows_lack_is_named():
    funcs = resolve_reward_funcs(["tests.plugins.rewards.exact_sum"], None)
    check_columns(funcs, ["answer"])
    with pytest.raises(
        ValueError,
        match=r"`--data.reward_funcs\[0\]` 'exact_sum' needs \['answer'\], which the rows "
        r"do not have; their columns: \['solution'\]",
    ):
        check_columns(funcs, ["solution"])


def _limited(funcs, timeout_s=1.0):
    """``_call`` with a time limit; its seconds too."""
    start = time.perf_counter()
    out = call_reward_funcs(
        resolve_reward_funcs(funcs, None), PROMPTS, COMPLETIONS, IDS, COLUMNS, {}, timeout_s
    )
    return out, time.perf_counter() - start


def _off_main(fn, *args):
    """``fn(*args)`` on a thread other than the main one (as a Python user's own thread calls)."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn(*args)))
    t.start()
    t.join(30)
    return box[0]


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"earl-reward-{name}"]


@pytest.fixture
def wake():
    """Ends the hung functions' 60 s sleep after the test, and waits for their threads."""
    rewards_plugin.WAKE.clear()
    yield
    rewards_plugin.WAKE.set()
    for t in _threads("sleepy") + _threads("stalls_on_second_row"):
        t.join(10)
    rewards_plugin.WAKE.clear()


LATE = "did not return within 1 s (`--model.rollout.reward_timeout_s`)"


def test_a_hung_reward_function_is_interrupted_at_the_limit_and_the_others_score(wake):
    """On the main thread (where ``earl`` scores) the sleeping function is interrupted where it
    sleeps: its rows are lost, nothing is left running, and the next batch calls it again."""
    for _ in range(2):
        (fine, hung), seconds = _limited(
            ["tests.plugins.rewards.exact_sum", "tests.plugins.rewards.sleepy"]
        )
        assert seconds < 5, "waited for the 60 s sleep"
        assert fine.values == [1.0, 0.0, 1.0] and fine.errors == [None] * 3
        assert hung.values == [None] * 3
        assert hung.errors == [f"reward function 'sleepy' {LATE}"] * 3
        assert _threads("sleepy") == [], "interrupted, not left running"


def test_off_the_main_thread_a_hung_function_is_abandoned_and_holds_one_thread(wake):
    (hung,), seconds = _off_main(_limited, ["tests.plugins.rewards.sleepy"])
    assert seconds < 5 and hung.errors == [f"reward function 'sleepy' {LATE}"] * 3
    # the next batch: the abandoned call still sleeps, so the function is not called again
    (again,), seconds = _off_main(_limited, ["tests.plugins.rewards.sleepy"])
    assert (
        seconds < 0.5
        and again.errors
        == [
            "reward function 'sleepy' is still running its call on an earlier batch, abandoned after "
            "1 s; its rows are not scored until that call returns"
        ]
        * 3
    )
    assert len(_threads("sleepy")) == 1, "one abandoned thread, however many batches"
    rewards_plugin.WAKE.set()  # the abandoned call returns: the function is called again
    _threads("sleepy")[0].join(10)
    (back,), _ = _off_main(_limited, ["tests.plugins.rewards.sleepy"])
    assert back.values == [1.0] * 3 and back.errors == [None] * 3


def test_a_hung_async_reward_function_is_cancelled_at_the_limit():
    (hung,), seconds = _limited(["tests.plugins.rewards.asleep"])
    assert seconds < 5 and hung.errors == [f"reward function 'asleep' {LATE}"] * 3
    (again,), seconds = _limited(["tests.plugins.rewards.asleep"])
    assert seconds < 5 and again.errors == hung.errors, "cancelled: called again, not refused"
    time.sleep(0.2)
    assert _threads("asleep") == [], "nothing left running"


@pytest.mark.parametrize("main", [True, False], ids=["main_thread", "other_thread"])
def test_the_rows_scored_before_the_limit_are_kept(wake, main):
    args = (["tests.plugins.rewards.stalls_on_second_row"],)
    (out,), seconds = _limited(*args) if main else _off_main(_limited, *args)
    assert seconds < 5
    assert out.values == [1.0, None, None]
    late = f"reward function 'stalls_on_second_row' {LATE}"
    assert out.errors == [None, late, late]


def test_plain_functions_run_on_the_main_thread_with_or_without_a_limit():
    seen = []

    def where(completions, **kw):
        seen.append(threading.current_thread())
        return [0.0] * len(completions)

    _call([where])
    _limited([where])
    _off_main(_limited, [where])
    main = threading.main_thread()
    assert seen[0] is main and seen[1] is main, "a limit keeps them where they were"
    assert seen[2] is not main and seen[2].name == "earl-reward-where", (
        "elsewhere: their own thread"
    )


def test_math_verify_keeps_its_own_alarms_under_a_time_limit():
    """math-verify's parse with its default time-out uses signal.alarm, which only the main
    thread may: under a limit it still runs there, and scores."""
    (out,), _ = _limited(["tests.plugins.rewards.verified"], timeout_s=30.0)
    assert out.errors == [None] * 3 and out.values == [1.0, 0.0, 1.0]


def test_trls_own_accuracy_reward_runs_under_a_time_limit():
    """On a thread of its own (a limit is set) math-verify cannot use signal.alarm; TRL's function
    then turns math-verify's own time-outs off, and scores as on the main thread."""
    (out,) = call_reward_funcs(
        resolve_reward_funcs(["trl.rewards.accuracy_reward"], None),
        [[{"role": "user", "content": "1+1"}]] * 2,
        [[{"role": "assistant", "content": r"\boxed{2}"}], [{"role": "assistant", "content": "4"}]],
        [[1], [2]],
        {"solution": ["2", "4"]},
        timeout_s=30.0,
    )
    assert out.values == [1.0, 0.0] and out.errors == [None, None]
