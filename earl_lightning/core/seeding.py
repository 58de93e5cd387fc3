"""One seed drives a run. A part's ``seed`` left unset (None: the module's and the data's, the
warm start's) takes the run's seed: the value ``seed_everything`` was given, which Lightning keeps in
the ``PL_GLOBAL_SEED`` environment variable (the ``earl`` commands' ``--seed_everything``, 0 unless
given; in Python, ``lightning.seed_everything(s)`` before the parts are built). A part's seed set
on purpose is kept. Nothing here imports from the project."""

from __future__ import annotations

import os

from earl_lightning.core.checks import is_int


def run_seed(seed: int | None, arg: str) -> int:
    """``seed`` when set (checked: an integer >= 0; ``arg`` names it in the error), else the run's
    seed (``PL_GLOBAL_SEED``), else 0."""
    if seed is None:
        return int(os.environ.get("PL_GLOBAL_SEED", "0"))
    if not (is_int(seed) and seed >= 0):
        raise ValueError(
            f"`{arg}` must be an integer >= 0, or null for the run's seed (`--seed_everything`), "
            f"got {seed!r}"
        )
    return seed
