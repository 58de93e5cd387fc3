"""The one-process group the vLLM backend makes for ``external_launcher`` leaves no launcher address
behind: its port stays bound for the life of the process, and a launcher started later in it (a
second fit, a test) would inherit ``MASTER_PORT`` and fail with EADDRINUSE."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import os, torch.distributed as dist
from earl_lightning.rollout.backends.vllm_support import ensure_process_group
ensure_process_group()
assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
print(sorted(v for v in ("MASTER_ADDR", "MASTER_PORT") if v in os.environ),
      os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"])
"""


def test_single_process_group_sets_ranks_but_no_master_address():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "0", "0", "1"]


def test_standalone_env_drops_every_launcher_variable():
    from earl_lightning.parallel.launch_env import LAUNCHER_VARS, standalone_env

    caller = {
        **{v: "1" for v in LAUNCHER_VARS},
        "TORCHELASTIC_RUN_ID": "x",
        "PATH": "/bin",
        "RANKING": "kept",
    }
    assert standalone_env(caller, OMP_NUM_THREADS="2") == {
        "PATH": "/bin",
        "RANKING": "kept",
        "OMP_NUM_THREADS": "2",
    }
    listed = subprocess.run(
        [sys.executable, "-m", "earl_lightning.parallel.launch_env"],
        capture_output=True,
        text=True,
        env={**caller, "PATH": os.environ["PATH"]},
        timeout=60,
    )
    assert listed.stdout.split() == sorted([*LAUNCHER_VARS, "TORCHELASTIC_RUN_ID"])


def test_free_port_is_bindable_and_a_store_listens_on_it():
    import datetime

    import torch.distributed as dist

    from earl_lightning.parallel.launch_env import free_port

    port = free_port()
    assert 1024 <= port <= 65535
    store = dist.TCPStore(
        "127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30)
    )
    store.set("k", "v")
    assert store.get("k") == b"v"
