"""A call on the main thread interrupted at its time limit, where it waits (earl_lightning/tasks/
deadline.py): what a hung reward function gets instead of the whole run hanging."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import pytest

from earl_lightning.tasks.deadline import CallTimeout, call_with_limit, can_interrupt

pytestmark = pytest.mark.skipif(not can_interrupt(), reason="needs the main thread and Linux")


def test_a_sleeping_call_is_interrupted_where_it_sleeps_and_its_place_reported():
    where = []

    def sleeps():
        time.sleep(60)

    start = time.perf_counter()
    with pytest.raises(CallTimeout, match="did not return within 0.5 s"):
        call_with_limit(sleeps, 0.5, lambda frame: where.append(frame.f_code.co_name))
    assert time.perf_counter() - start < 3 and where == ["sleeps"]


def test_a_call_that_swallows_the_interrupt_is_interrupted_again():
    swallowed = []

    def stubborn():
        try:
            threading.Event().wait(60)
        except BaseException as err:  # noqa: BLE001 - what a careless function does
            swallowed.append(err)
        time.sleep(60)

    start = time.perf_counter()
    with pytest.raises(CallTimeout):
        call_with_limit(stubborn, 0.5)
    assert time.perf_counter() - start < 5 and len(swallowed) == 1


def test_a_call_in_time_returns_and_a_late_signal_interrupts_nothing():
    assert call_with_limit(lambda: 7, 5.0) == 7
    # a signal after the call (the watchdog's last one, delivered late): the handler stays
    # installed, so it neither ends the process (the default action) nor interrupts what follows
    signal.pthread_kill(threading.main_thread().ident, signal.SIGRTMIN)
    assert call_with_limit(lambda: time.sleep(0.3) or 8, 5.0) == 8


def test_a_handler_put_back_by_lightnings_trainer_is_installed_again():
    """Lightning's Trainer snapshots every signal's handler when a fit starts and restores them all
    at its end: a handler installed during a fit (the first reward function timed there) is gone
    after it. The next limited call must install it again; before, the watchdog's signal met the
    default action and ended the process (a pytest worker crashed so)."""
    code = """
import time
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from earl_lightning.tasks.deadline import CallTimeout, call_with_limit

at_fit_start = _SignalConnector._get_current_signal_handlers()
assert call_with_limit(lambda: 7, 5.0) == 7  # installed during the 'fit'
for signum, handler in at_fit_start.items():  # the fit's teardown
    if handler is not None:
        _SignalConnector._register_signal(signum, handler)
try:
    call_with_limit(lambda: time.sleep(60), 0.5)
except CallTimeout:
    print("interrupted")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "interrupted"), proc.stderr[-2000:]


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise _Interrupted


@pytest.mark.parametrize("which", ["env calls", "reward function"])
def test_a_signal_taken_by_another_thread_ends_a_wait_with_no_limit(which):
    """A terminal's ctrl-C goes to the process, and the kernel may hand it to any thread; CPython
    then runs the handler on the main thread only when it next runs bytecode. A main thread blocked
    for ever (calls with no time limit that hang) must still get there: it waits in slices."""
    from earl_lightning.rollout.call_pool import CallPool
    from earl_lightning.tasks.rewards import call_reward_funcs, resolve_reward_funcs

    async def hangs(prompts, completions, completion_ids, **columns):
        await asyncio.sleep(20)  # on the rewards' event loop thread, left to end on its own
        return [1.0] * len(prompts)

    release = threading.Event()
    taker = threading.Thread(target=release.wait, name="takes-the-signal", daemon=True)
    taker.start()
    previous = signal.signal(signal.SIGUSR1, _raise_interrupted)
    # the hung call ends after 20 s whatever happens, so that a failure cannot hang the suite
    threading.Timer(20.0, release.set).start()
    threading.Timer(0.5, signal.pthread_kill, (taker.ident, signal.SIGUSR1)).start()
    start = time.perf_counter()
    try:
        with pytest.raises(_Interrupted):
            if which == "env calls":
                pool = CallPool(1)
                pool.wait([[pool.submit(release.wait)]], timeout_s=None)
            else:  # an async reward function with no time limit: waited on from a helper thread
                call_reward_funcs(resolve_reward_funcs([hangs], None), ["p"], ["c"], [[1]], {})
        assert time.perf_counter() - start < 5
    finally:
        release.set()
        signal.signal(signal.SIGUSR1, previous)
