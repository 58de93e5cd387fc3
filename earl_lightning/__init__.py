"""earl_lightning: agentic RL of LLMs on PyTorch Lightning, with EARL's adaptive parallelism and dispatcher."""

__version__ = "0.1.0"
