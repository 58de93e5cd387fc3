"""earl_lightning: agentic RL of LLMs on PyTorch Lightning, with EARL's adaptive parallelism and dispatcher."""

from earl_lightning.warnings_filter import install_warning_filters

__version__ = "0.2.0"

# Two warnings that Lightning raises from its own internals, whatever the caller does
# (warnings_filter.py says why each cannot be fixed at its cause); filtered narrowly, for Python
# users and the `earl` command alike.
install_warning_filters()
