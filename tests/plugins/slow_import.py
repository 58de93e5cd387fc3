"""An environment whose module takes 1.5 s to import, as one that imports torch or Lightning at
the top does (``scripts/chaos_plugins.py``): under ``call_isolation: process`` each fresh worker
pays it before the environment's first call."""

from __future__ import annotations

import time

from tests.plugins.workers import Where

time.sleep(1.5)


class SlowImportWhere(Where):
    """:class:`~tests.plugins.workers.Where`, from a module slow to import."""
