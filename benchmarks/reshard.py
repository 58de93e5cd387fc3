"""Layout-aware vs naive reshard: bytes moved and seconds, train layout -> another stage's layout.

The source is the train copy (FSDP2 x TP on a ("dp", "tp") mesh); the destination is the stage
replica EarlStrategy builds (TP-sharded, dp-replicated). ``bytes`` is the sum over ranks of the bytes
each rank received from other ranks; ``seconds`` is the slowest rank's time (median of repeats).

    python benchmarks/reshard.py --quick        # < 3 minutes on 2 CPU cores, gloo
    python benchmarks/reshard.py                # more layout pairs, 3 repeats

Writes benchmarks/results/reshard.csv with columns world,model,src,dst,method,bytes,seconds.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from earl_lightning.models import make_tiny_model
from earl_lightning.parallel.launch_env import free_port
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.parallelize import build_replica, parallelize_model
from earl_lightning.parallel.reshard import Resharder, reshard_naive

MODELS = {"tiny": "earl-tiny", "100m": "earl-tiny-100m"}
# (world, model) -> [(train layout, stage layout)]; tp must divide the heads (tiny: 4/2, 100m: 12/4).
PAIRS_QUICK = {
    (2, "tiny"): [((2, 1), (1, 2))],
    (2, "100m"): [((2, 1), (1, 2))],
    (4, "tiny"): [((4, 1), (2, 2))],
    (4, "100m"): [((4, 1), (1, 4))],
}
PAIRS_FULL = {
    (2, "tiny"): [((2, 1), (1, 2)), ((1, 2), (2, 1))],
    (2, "100m"): [((2, 1), (1, 2)), ((1, 2), (2, 1))],
    (4, "tiny"): [((4, 1), (2, 2)), ((2, 2), (4, 1)), ((2, 2), (2, 2))],
    (4, "100m"): [((4, 1), (1, 4)), ((4, 1), (2, 2)), ((2, 2), (1, 4)), ((1, 4), (4, 1))],
}


def _mesh(layout: Layout):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))


def _timed(fn, repeats: int) -> tuple[int, float]:
    """(bytes this rank received, median seconds of the slowest rank)."""
    times, nbytes = [], 0
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        nbytes = fn().bytes_received
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return nbytes, statistics.median(times)


def _run_pair(model, src: Layout, dst: Layout, repeats: int) -> list[tuple[str, int, float]]:
    replica = build_replica(model, mesh=_mesh(dst), layout=dst, device="cpu")
    # plan built once, outside the timing, as the strategy does
    resharder = Resharder(model, replica)
    rows = []

    def naive() -> int:
        return reshard_naive(model, replica)

    for method, fn in (("layout_aware", resharder.run), ("naive", naive)):
        nbytes, seconds = _timed(fn, repeats)
        total = torch.tensor(nbytes, dtype=torch.int64)
        dist.all_reduce(total)
        rows.append((method, int(total.item()), seconds))
    return rows


def _worker(
    rank: int, world: int, port: int, jobs: dict, paths: dict, repeats: int, out_dir: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM

    rows = []
    try:
        for (w, name), pairs in jobs.items():
            if w != world:
                continue
            for src_dims, dst_dims in pairs:
                src, dst = Layout(*src_dims), Layout(*dst_dims)
                model = AutoModelForCausalLM.from_pretrained(paths[name])
                parallelize_model(model, mesh=_mesh(src), layout=src)
                for method, nbytes, seconds in _run_pair(model, src, dst, repeats):
                    rows.append(
                        (world, name, src.name, dst.name, method, nbytes, round(seconds, 5))
                    )
                del model
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, f"rows{world}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one pair per (world, model), 2 repeats"
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "reshard.csv"))
    args = parser.parse_args()
    pairs = PAIRS_QUICK if args.quick else PAIRS_FULL
    jobs = {k: v for k, v in pairs.items() if k[0] in args.worlds and k[1] in args.models}
    paths = {
        name: str(make_tiny_model(MODELS[name])) for name in args.models
    }  # built once, before spawning
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            mp.spawn(
                _worker,
                args=(world, free_port(), jobs, paths, 2 if args.quick else 3, tmp),
                nprocs=world,
            )
            rows += torch.load(os.path.join(tmp, f"rows{world}.pt"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["world", "model", "src", "dst", "method", "bytes", "seconds"])
        writer.writerows(rows)
    print(
        f"{'world':>5} {'model':>5} {'src':>8} {'dst':>8} {'method':>12} {'MiB':>9} {'seconds':>8}"
    )
    for world, model, src, dst, method, nbytes, seconds in rows:
        print(
            f"{world:>5} {model:>5} {src:>8} {dst:>8} {method:>12} {nbytes / 2**20:>9.2f} {seconds:>8.3f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
