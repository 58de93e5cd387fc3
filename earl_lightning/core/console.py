"""The one channel from earl_lightning to the person running it: :func:`info`, :func:`warn` and
:func:`error`, all through the ``earl_lightning`` logger.

- Rank zero only: every rank runs the same code, and N copies of a line say nothing more. A
  message about this rank's own work (an environment that failed here, a reward function that hung
  here) is passed ``every_rank=True``; so is an error that ends this rank.
- Each message is one ``write`` to stderr (two ranks' lines never run together), as written (the
  ``earl: error: ...`` lines of the ``earl`` command included), unless the application's root
  logger already writes to the console: it then shows the message, once, by propagation. An
  application or a test reads the records (``caplog``), raises the level or adds a handler as for
  any logger.
- ``warnings.warn`` is kept for deprecations (a setting or an import path under an old name);
  ``print`` for what a command's output is (``earl plan``'s tables, a result line on stdout).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = logging.getLogger("earl_lightning")


def rank() -> int:
    """This process's global rank as Lightning set it (``rank_zero_only.rank``), else the
    launcher's ``RANK`` (0 in a single process)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    known = getattr(rank_zero_only, "rank", None)
    return int(known if known is not None else os.environ.get("RANK", 0))


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "every_rank", False) or rank() == 0


def _writes_to_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return stream is not None and stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


class _Stderr(logging.Handler):
    """The message on ``sys.stderr`` (looked up at each record: a test's capture sees it) in one
    write, unless a handler of the root logger writes to the console already."""

    def emit(self, record: logging.LogRecord) -> None:
        if any(_writes_to_console(h) for h in logging.getLogger().handlers):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a failed write is reported, not raised
            self.handleError(record)


if not any(isinstance(h, _Stderr) for h in LOGGER.handlers):  # a reload adds none twice
    LOGGER.setLevel(logging.INFO)
    LOGGER.addFilter(_RankZero())
    LOGGER.addHandler(_Stderr())


def info(message: str, *, every_rank: bool = False) -> None:
    """What the run is doing that its user may want to know (a budget chosen, a checkpoint taken)."""
    LOGGER.info(message, extra={"every_rank": every_rank}, stacklevel=2)


def warn(message: str, *, every_rank: bool = False, exc_info: BaseException | None = None) -> None:
    """Something is wrong but the run goes on (a row dropped, a fault absorbed); ``exc_info``: the
    exception whose traceback follows the message."""
    LOGGER.warning(message, extra={"every_rank": every_rank}, exc_info=exc_info, stacklevel=2)


def error(message: str) -> None:
    """The line a command ends with (``earl: error: ...``), on every rank that ends so."""
    LOGGER.error(message, extra={"every_rank": True}, stacklevel=2)
