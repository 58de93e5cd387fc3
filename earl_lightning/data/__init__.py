"""Deprecated package: its modules moved in 0.3.0 (``batches``, ``modules.datamodule``, ``dispatch.exchange``); each old path warns once and is removed in 0.4."""
