"""Errors a run can end with that are the user's to fix (a broken environment, an unreadable file):
the `earl` command prints each as one line naming what is wrong, without a traceback.

Sits below every layer: it imports nothing from the project.
"""

from __future__ import annotations


class EarlError(Exception):
    """Base of the errors that end a run with one clear line (the `earl` command exits non-zero)."""


class EnvironmentFailure(EarlError):
    """Too many episodes of one RL step failed inside the environment (``rollout.max_failed_share``)."""
