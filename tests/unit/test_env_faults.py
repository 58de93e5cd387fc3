"""Environment faults end their episode, never the rollout: an exception, a wrong return type or a
hung call (``env_timeout_s``) in building, resetting or stepping an env; the first fault of each
kind is logged with its traceback; ``check_env_failures`` stops the run past the failed share."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from earl_lightning.core.errors import EnvironmentFailure
from earl_lightning.models import load_tokenizer, make_tiny_model
from earl_lightning.parallel.collectives import Reducer
from earl_lightning.rollout import EpisodeSpec, HFBackend, SamplingConfig, rollout
from earl_lightning.rollout.env_calls import forget_call_kinds, reset_logged_faults
from earl_lightning.stages import check_env_failures
from tests.plugins.faulty_envs import RELEASE

P = "tests.plugins.faulty_envs."
RECALL = dict(num_turns=3, padding_chars=4)
SAMPLING = SamplingConfig(max_new_tokens=4, seed=3, temperature=1.5)
STEP_CONTRACT = "an Env's step must return StepResult(observation, reward, done, info)"


@pytest.fixture(scope="module")
def lm():
    path = make_tiny_model("earl-tiny", hidden_size=64, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(str(path))


@pytest.fixture(autouse=True)
def _fresh_fault_log():
    reset_logged_faults()  # each test sees the first fault of each kind logged
    forget_call_kinds()  # ... and every kind of call first run on the calling thread
    yield
    reset_logged_faults()
    forget_call_kinds()


@pytest.fixture
def threads(monkeypatch):
    """The Python threads started while the test runs."""
    started: list[threading.Thread] = []
    start = threading.Thread.start

    def recording_start(self):
        started.append(self)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    return started


def _specs(env: str, n: int = 6, **kwargs) -> list[EpisodeSpec]:
    return [
        EpisodeSpec(env, seed=s, group_id=s, episode_id=s, env_kwargs={**RECALL, **kwargs})
        for s in range(n)
    ]


def _run(lm, specs, **kw):
    model, tok = lm
    return rollout(
        specs, HFBackend(model, tok), tok, SAMPLING, max_turns=4, max_context_tokens=2048, **kw
    )


def _fault_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "earl_lightning"]


# The error of a faulty episode (seed ``s``), as a regex; the turn its episode ended on (None: at reset).
FAULTS = {
    "RaisesInStep": (r"step\(\) raised RuntimeError\('step broke'\)", 1),
    "RaisesInReset": (r"reset\(\) raised OSError\('reset broke'\)", None),
    "GymTupleStep": (
        re.escape(
            f"step() returned a tuple; {STEP_CONTRACT} (a gym-style (observation, reward, "
            f"terminated, truncated, info) tuple is not one)"
        ),
        1,
    ),
    "GymnasiumReset": (
        r"reset\(\) returned tuple \('.{1,60}; an Env's reset\(seed\) must return the first "
        r"observation as a str \(gymnasium's reset returns \(observation, info\)\)",
        None,
    ),
    "BadStepResult": (r"step\(\) returned a StepResult whose reward nan is not a finite number", 1),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_fails_its_episode_and_the_healthy_ones_play_on(lm, caplog, name):
    pattern, turn = FAULTS[name]
    reference = _run(lm, _specs("recall"))
    with caplog.at_level(logging.WARNING, logger="earl_lightning"):
        episodes = _run(lm, _specs(P + name, every=2, turn=1))  # seeds 0, 2, 4 are faulty
    for ep, ref in zip(episodes, reference):
        if ep.spec.seed % 2:
            assert ep.error is None and ep.token_ids == ref.token_ids and ep.reward == ref.reward
            assert ep.done and ep.num_turns == 3
            continue
        assert re.fullmatch(rf"env '{P}{name}' \(seed {ep.spec.seed}\): {pattern}", ep.error), (
            ep.error
        )
        assert ep.done and ep.reward == 0.0 and ep.turn_rewards == [0.0] * ep.num_turns
        if turn is None:
            assert ep.token_ids == [] and ep.num_turns == 0
        else:  # the transcript up to the faulty step is kept
            assert ep.num_turns == turn + 1 and ep.token_ids == ref.token_ids[: len(ep.token_ids)]
    (record,) = _fault_records(caplog)  # three faults of one kind: logged once
    assert record.levelno == logging.WARNING and record.getMessage().startswith(
        episodes[0].error + "\n"
    )
    assert "end their episode and count in env/errors" in record.getMessage()
    assert (record.exc_info is not None) == ("raised" in pattern)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="earl_lightning"):
        assert _run(lm, _specs(P + name, every=2, turn=1))[0].error == episodes[0].error
    assert _fault_records(caplog) == []  # not again in this process


@pytest.mark.parametrize(
    "what, problem",
    [
        ("reward", r"reward nan is not a finite number"),
        ("done", r"done array\(\[ True, False\]\) is not a bool"),
        ("info", r"info is list \['invalid_action'\], not a dict"),
        ("observation", r"observation is NoneType None, not a str \(the episode is not done\)"),
    ],
)
def test_each_bad_field_of_a_step_result_is_named(lm, what, problem):
    (ep,) = _run(lm, _specs(P + "BadStepResult", n=1, what=what))
    assert re.fullmatch(
        rf"env '{P}BadStepResult' \(seed 0\): step\(\) returned a StepResult whose {problem}",
        ep.error,
    ), ep.error


def test_the_traceback_is_logged_once_per_kind(lm, caplog):
    specs = _specs(P + "RaisesInStep", n=2) + [
        EpisodeSpec(P + "RaisesInReset", seed=7, group_id=9, episode_id=9, env_kwargs=RECALL),
        EpisodeSpec(P + "RaisesInReset", seed=8, group_id=9, episode_id=10, env_kwargs=RECALL),
    ]
    with caplog.at_level(logging.WARNING, logger="earl_lightning"):
        episodes = _run(lm, specs)
    assert all(ep.error for ep in episodes)
    # reset faults come first: every env is reset before turn 1
    reset, step = _fault_records(caplog)
    assert reset.getMessage().startswith(
        f"env '{P}RaisesInReset' (seed 7): reset() raised OSError('reset broke')"
    )
    assert step.getMessage().startswith(
        f"env '{P}RaisesInStep' (seed 0): step() raised RuntimeError('step broke')"
    )
    assert "builtins.RuntimeError" in step.getMessage()
    assert (
        'raise RuntimeError("step broke")' in caplog.text
        and 'raise OSError("reset broke")' in caplog.text
    )


def test_the_first_fault_reaches_stderr_without_logging_set_up():
    code = (
        "from earl_lightning.rollout.env_calls import EnvCalls\n"
        "from earl_lightning.rollout.types import EpisodeSpec\n"
        f"spec = EpisodeSpec('{P}RaisesInStep', seed=4, group_id=0, episode_id=0)\n"
        "calls = EnvCalls()\nenv, _ = calls.start(spec)\n"
        "for _ in range(2):\n"
        "    try:\n        calls.step(spec, env, '1')\n    except Exception as e:\n        print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    error = f"env '{P}RaisesInStep' (seed 4): step() raised RuntimeError('step broke')"
    assert proc.stdout.splitlines() == [error, error]
    assert proc.stderr.count(error) == 1 and "Traceback (most recent call last)" in proc.stderr
    assert 'raise RuntimeError("step broke")' in proc.stderr


def _env_call_threads(threads) -> list[threading.Thread]:
    return [t for t in threads if t.name == "earl-env-call"]


def test_a_hung_call_is_interrupted_then_its_kind_runs_on_threads(lm, caplog, threads):
    """Calls that only compute run on the rollout's own thread, limited by the deadline's signal: a
    hang there is interrupted where it waits. From then on that kind of call runs on worker
    threads, where a hang is abandoned (Python cannot stop a thread) and the others go on."""
    limit = 0.5
    t0 = time.perf_counter()
    reference = _run(lm, _specs("recall"), env_timeout_s=limit)
    healthy_s = time.perf_counter() - t0
    # recall's calls only compute: they ran on this thread (a loaded machine may still move a kind
    # whose first calls waited on the cores, so this is not asserted here)
    threads.clear()
    RELEASE.clear()
    try:
        t0 = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="earl_lightning"):
            episodes = _run(
                lm, _specs(P + "HangsInStep", every=3, turn=1, sleep_s=60.0), env_timeout_s=limit
            )
        elapsed = time.perf_counter() - t0
        stuck = [t for t in _env_call_threads(threads) if t.is_alive()]
        assert len(stuck) >= 1  # the second hung call still runs in its daemon thread ...
    finally:
        RELEASE.set()
    # ... and the rollout waited for neither (each sleeps 60 s): the bound leaves room for a
    # loaded machine, where a rollout's own time can double between two runs
    assert elapsed < 2 * healthy_s + 2 * limit + 5.0, (elapsed, healthy_s)
    hung = f"env '{P}HangsInStep' (seed {{}}): step() did not return within env_timeout_s=0.5s; "
    for ep, ref in zip(episodes, reference):
        if ep.spec.seed % 3:
            assert ep.error is None and ep.token_ids == ref.token_ids and ep.reward == ref.reward
            continue
        fate = (
            "it was interrupted where it was and the env is abandoned"
            if ep.spec.seed == 0  # the first hang: on the rollout's thread
            else "the env is abandoned (the call keeps running in a daemon thread)"
        )
        assert ep.error == hung.format(ep.spec.seed) + fate
        assert ep.num_turns == 2 and ep.reward == 0.0
    (record,) = _fault_records(caplog)
    assert (
        "where the call is stuck:" in record.getMessage() and "RELEASE.wait(" in record.getMessage()
    )
    assert all(t.daemon for t in threads)
    # an abandoned worker exits once its call returns (the others when the rollout closes)
    for t in _env_call_threads(threads):
        t.join(timeout=10)
        assert not t.is_alive()


def _run_on_a_thread(lm, specs, **kw):
    """A rollout run from a thread other than the main one: with a time limit its calls cannot be
    interrupted there, so every call runs on the worker threads."""
    out = []
    runner = threading.Thread(target=lambda: out.append(_run(lm, specs, **kw)))
    runner.start()
    runner.join()
    return out[0]


def test_results_do_not_depend_on_where_the_calls_run(lm, threads):
    specs = [
        EpisodeSpec(
            P + name if name else "recall",
            seed=s,
            group_id=s,
            episode_id=s,
            env_kwargs={**RECALL, **({"turn": s % 2} if name else {})},
        )
        for s, name in enumerate(["", *FAULTS, "", "BadStepResult"])
    ]
    here = _run(lm, specs, env_timeout_s=30.0)
    # (on a loaded machine ``here`` may move a kind of call to worker threads: count each run's own)
    before = len(threads)
    one_worker = _run_on_a_thread(lm, specs, env_timeout_s=30.0, call_workers=1)
    # one worker: the calls one at a time, in order
    assert len(_env_call_threads(threads[before:])) == 1
    before = len(threads)
    threaded = _run_on_a_thread(lm, specs, env_timeout_s=30.0)
    assert len(_env_call_threads(threads[before:])) > 3
    assert [ep.error is None for ep in here] == [
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        False,
    ]
    for a, b, c in zip(here, one_worker, threaded):
        fields = [(x.error, x.token_ids, x.reward, x.turn_rewards, x.messages) for x in (a, b, c)]
        assert fields[0] == fields[1] == fields[2]


def test_calls_that_wait_move_to_the_worker_threads(lm, threads):
    """A kind of call seen waiting (here a step that sleeps 50 ms) runs on the worker threads
    after three such calls, where the episodes' waits overlap; one that only computes does not."""
    specs = _specs(P + "HangsInStep", n=8, every=1, turn=0, sleep_s=0.05)
    RELEASE.clear()
    first = _run(lm, specs, env_timeout_s=30.0)
    # the first three steps waited on the rollout's thread; the others ran on workers
    assert len(_env_call_threads(threads)) >= 2
    threads.clear()
    again = _run(lm, specs, env_timeout_s=30.0)  # every step on the workers now
    assert len(_env_call_threads(threads)) >= 2
    assert [(e.error, e.token_ids) for e in first] == [(e.error, e.token_ids) for e in again]
    assert all(e.error is None for e in first)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True, "5"])
def test_env_timeout_must_be_positive(lm, value):
    with pytest.raises(
        ValueError,
        match=re.escape(f"`env_timeout_s` must be a positive number or None, got {value!r}"),
    ):
        _run(lm, _specs("recall", n=1), env_timeout_s=value)


def test_an_unknown_env_still_raises(lm):
    with pytest.raises(
        ValueError,
        match=r"`env` 'tests.plugins.faulty_envs.Nope': module 'tests.plugins.faulty_envs' has "
        r"no attribute 'Nope'",
    ):
        _run(lm, _specs(P + "Nope", n=1))


# ---- the failed share stops the run (one process; two: tests/distributed/test_env_faults.py) -----
def test_a_step_whose_episodes_all_failed_stops_the_run(lm):
    episodes = _run(lm, _specs(P + "RaisesInReset", n=4))
    with pytest.raises(
        EnvironmentFailure,
        match=re.escape(
            "4 of 4 episodes of RL step 7 failed inside the environment (`--model.rollout.max_failed_share` 1); "
            "the first here: "
        )
        + r".*"
        + re.escape(
            f"env '{P}RaisesInReset' (seed 0): reset() raised OSError('reset broke'). Fix the environment, or raise "
            "max_failed_share to train through failures"
        ),
    ):
        check_env_failures(episodes, Reducer(), 1.0, step=7)


def test_a_share_below_the_limit_trains_on(lm):
    episodes = _run(lm, _specs(P + "RaisesInStep", n=8, every=4))  # seeds 0 and 4: 2 of 8
    assert sum(ep.error is not None for ep in episodes) == 2
    check_env_failures(episodes, Reducer(), 0.5, step=0)
    check_env_failures(episodes, Reducer(), 1.0, step=0)
    with pytest.raises(
        EnvironmentFailure, match=r"^2 of 8 episodes of RL step 0 failed .*max_failed_share` 0.25\)"
    ):
        check_env_failures(episodes, Reducer(), 0.25, step=0)


def test_a_gymnasium_reset_fails_at_setup_with_a_clear_error():
    from earl_lightning.modules import AgenticRLModule
    from earl_lightning.modules.datamodule import EpisodeDataModule
    from earl_lightning.modules.rollout_setup import check_first_observation

    module = AgenticRLModule()
    dm = EpisodeDataModule(
        env="tests.plugins.faulty_envs.GymnasiumReset",
        env_kwargs={"every": 1},
        batch_size=4,
        group_size=2,
        eval_episodes=0,
    )
    with pytest.raises(
        ValueError,
        match=r"`--data.env` 'tests.plugins.faulty_envs.GymnasiumReset': env .* reset\(\) "
        r"returned tuple .*; an Env's reset\(seed\) must return the first "
        r"observation as a str \(gymnasium's reset returns",
    ):
        check_first_observation(module.rollout_config, module.tokenizer, dm.first_spec())
