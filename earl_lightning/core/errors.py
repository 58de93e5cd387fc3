"""Errors a run can end with that are the user's to fix (a broken environment, an unreadable file):
the `earl` command prints each as one line naming what is wrong, without a traceback.

Sits below every layer: it imports nothing from the project.
"""

from __future__ import annotations


class EarlError(Exception):
    """Base of the errors that end a run with one clear line (the `earl` command exits non-zero)."""


class EnvironmentFailure(EarlError):
    """Too many episodes of one RL step failed inside the environment (``rollout.max_failed_share``)."""


class RewardFunctionFailure(EarlError):
    """Too many episodes of one RL step could not be scored by a reward function
    (``rollout.max_failed_share``)."""


class CheckpointError(EarlError):
    """A checkpoint cannot be used: truncated or corrupt, or saved from another model."""


class ModelFilesError(EarlError, FileNotFoundError):
    """A local model directory lacks files a model needs (``config.json``, weights, tokenizer files).

    Also a FileNotFoundError: found while the `earl` command builds its classes it is a configuration
    error (exit 2), found later in the run an EarlError (exit 1); one line either way."""


class DiskFullError(EarlError):
    """No space left on the device a checkpoint or a log was being written to."""


class RankFailure(EarlError):
    """A collective failed because another rank died or stopped answering (its process was killed,
    it crashed, or the collective timed out); the run stops and can resume from its last checkpoint."""


class DemonstrationError(EarlError, ValueError):
    """A demonstration policy failed or answered something the model could never generate under
    the recipe's sampling settings (``earl sft``)."""
