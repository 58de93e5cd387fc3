"""Checkpoints: reading them with errors that name the file (:mod:`.files`, also the atomic writes
and the output-directory checks), the loaders that cannot run code (:mod:`.loaders`), a URL read
as a file (:mod:`.urls`), the checkpoint I/O a run writes through (:mod:`.io`:
``AtomicCheckpointIO``, ``DcpCheckpoints``) and the model export (:mod:`.export`, ``earl export``).

Until 0.3.0 ``earl_lightning.checkpoints`` was the module :mod:`.files` is now: a name imported
from here (``from earl_lightning.checkpoints import write_dir_atomically``) still gives its object
and warns once (``DeprecationWarning``); removed in 0.4.
"""

from earl_lightning.core.warnings_filter import moved_names

__getattr__ = moved_names(__name__, "earl_lightning.checkpoints.files", removed_in="0.4")
