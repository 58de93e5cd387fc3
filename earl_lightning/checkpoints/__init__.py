"""Checkpoints: reading them with errors that name the file (:mod:`.files`, also the atomic writes
and the output-directory checks), the loaders that cannot run code (:mod:`.loaders`), a URL read
as a file (:mod:`.urls`), the checkpoint I/O a run writes through (:mod:`.io`:
``AtomicCheckpointIO``, ``DcpCheckpoints``) and the model export (:mod:`.export`, ``earl export``).
"""
