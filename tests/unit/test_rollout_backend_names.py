"""``--model.rollout.backend`` names an entry of the generation-backend registry, checked when the
group is built: a user's registered backend (by name, or by import path) is accepted, and a bad
name is one line that lists the registered ones."""

from __future__ import annotations

import pytest

from earl_lightning.modules import AgenticRLModule, RolloutConfig
from earl_lightning.modules.views import exactly_on_policy
from earl_lightning.rollout.backends.registry import GENERATION_BACKENDS


def test_a_bad_backend_name_lists_the_registered_ones():
    with pytest.raises(ValueError) as err:
        RolloutConfig(backend="trt")
    line = str(err.value)
    assert line.startswith("unknown `--model.rollout.backend` 'trt'; valid generation backends: [")
    assert all(repr(name) in line for name in GENERATION_BACKENDS.names())
    assert "\n" not in line


def test_a_user_registered_backend_is_accepted_and_listed():
    import tests.plugins.backends  # noqa: F401 - registers `counting_hf`

    assert RolloutConfig(backend="counting_hf").backend == "counting_hf"
    path = "tests.plugins.backends.counting_hf"
    assert RolloutConfig(backend=path).backend == path
    with pytest.raises(ValueError, match=r"valid generation backends: \['counting_hf', 'hf'"):
        RolloutConfig(backend="counting_hff")


def test_a_user_backend_is_sized_as_hf_and_never_takes_the_on_policy_shortcut():
    """The memory model knows the HF and vLLM engines only; the trainer's own log-probs stand in
    for the sampled ones only under the HF backend, whose log-probs they are."""
    import tests.plugins.backends  # noqa: F401

    module = AgenticRLModule(rollout={"backend": "counting_hf"})
    assert module.workload.backend == "hf"
    assert not exactly_on_policy(
        module.rollout_config, module.algorithm_config, module.optim_config
    )
    assert exactly_on_policy(
        RolloutConfig(), module.algorithm_config, module.optim_config
    )  # the same groups with `hf`


def test_a_name_that_is_not_text_is_refused():
    with pytest.raises(ValueError, match=r"unknown `--model.rollout.backend` 3; valid generation"):
        RolloutConfig(backend=3)  # type: ignore[arg-type]
