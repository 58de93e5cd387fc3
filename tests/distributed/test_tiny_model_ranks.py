"""Every rank of a process group can build the offline tiny model: transformers >= 5.19 writes a
model from rank 0 only once torch.distributed is initialized, which left the shared cache with a
tokenizer and no weights when the ranks of a test raced to build it (all distributed tests then
failed on a fresh machine). And a directory such a build left behind is rebuilt, not returned."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from earl_lightning.models import make_tiny_model
from tests.distributed.launch import run_distributed

# a spec no other test builds: always built fresh here
SPEC = dict(hidden_size=32, intermediate_size=64)


def _build(rank: int, world: int, cache: str) -> list[str]:
    """Rank 1 builds first (the rank whose save transformers skips), then rank 0 finds its build."""
    import torch.distributed as dist

    os.environ["EARL_CACHE_DIR"] = cache
    if rank == 1:
        make_tiny_model("earl-tiny", **SPEC)
    dist.barrier()
    return sorted(os.listdir(make_tiny_model("earl-tiny", **SPEC)))


def test_every_rank_builds_a_whole_model_into_a_fresh_cache(tmp_path):
    listings = run_distributed(_build, 2, str(tmp_path))
    for files in listings:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files), files
    assert [p.name for p in tmp_path.iterdir()] == [
        next(tmp_path.iterdir()).name
    ]  # no temp dirs left


def test_an_incomplete_model_directory_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("EARL_CACHE_DIR", str(tmp_path))
    whole = Path(make_tiny_model("earl-tiny", **SPEC))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (whole / name).unlink()  # what the rank-0-only save left: the tokenizer alone
    again = Path(make_tiny_model("earl-tiny", **SPEC))
    assert (
        again == whole
        and (again / "model.safetensors").is_file()
        and (again / "config.json").is_file()
    )
    shutil.rmtree(again)
