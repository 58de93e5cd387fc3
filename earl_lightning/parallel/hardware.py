"""What a device and a cluster offer the time model: peak rates, memory and links, read from data
files (``parallel/devices/<NAME>.json``, each figure with its source), and a cluster written as
``NODESxPER_NODExDEVICE`` (``16x8xH100-80G``).

A profile's rates are datasheet figures; its efficiency factors and per-call overheads say how
much of them this project's code paths reach. For the GPUs those are stated assumptions (each
file's ``sources`` says which); the ``CPU`` profile's are fitted to measurements on the machine
this project is developed on (``benchmarks/plan_calibration.py --fit``). Pure Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from earl_lightning.core.checks import check_count, check_number

DEVICES_DIR = Path(__file__).parent / "devices"
_CLUSTER = re.compile(r"^(\d+)x(\d+)x(.+)$")
# fields that are fractions of a datasheet rate
_FRACTIONS = (
    "matmul_efficiency",
    "attention_efficiency",
    "memory_efficiency",
    "link_efficiency",
    "comm_overlap",
)


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or one CPU core): its memory, rates and how much of them is reached.

    Bandwidths are bytes per second in one direction, per device; ``peak_flops`` maps a dtype to
    dense FLOP/s. ``comm_overlap``: the share of a collective's time hidden under compute (FSDP's
    prefetch on a GPU's own streams: 1; gloo on the cores that compute: 0).
    """

    name: str
    description: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    max_devices_per_node: int
    matmul_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    link_efficiency: float
    comm_overlap: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    layer_overhead_s: float
    step_overhead_s: float
    sources: dict[str, str]

    def __post_init__(self) -> None:
        where = f"device profile {self.name!r}"
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"{where}: kind must be 'gpu' or 'cpu', got {self.kind!r}")
        check_count(f"{where}: memory_bytes", self.memory_bytes)
        check_count(f"{where}: max_devices_per_node", self.max_devices_per_node)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _FRACTIONS:
                check_number(f"{where}: {f.name}", value, low=0, high=1)
            elif f.name.endswith(("_bandwidth", "_s")):
                check_number(f"{where}: {f.name}", value, low=0, strict=not f.name.endswith("_s"))
        for dtype, flops in self.peak_flops.items():
            check_number(f"{where}: peak_flops[{dtype!r}]", flops, low=0, strict=True)

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s in ``dtype``."""
        if dtype not in self.peak_flops:
            raise ValueError(
                f"device profile {self.name!r} has no peak rate for dtype {dtype!r}; "
                f"it has {sorted(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    @classmethod
    def from_dict(cls, data: Any, source: str) -> DeviceProfile:
        if not isinstance(data, dict):
            raise ValueError(f"{source} must hold a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(f"{source}: missing fields {missing}, unknown fields {unknown}")
        return cls(**data)


def device_names() -> list[str]:
    """The profiles shipped with the package."""
    return sorted(p.stem for p in DEVICES_DIR.glob("*.json"))


@cache
def device_profile(name: str, arg: str = "device") -> DeviceProfile:
    """The profile called ``name`` (case-insensitive); an unknown name lists the known ones."""
    known = {n.lower(): n for n in device_names()}
    if not isinstance(name, str) or name.lower() not in known:
        raise ValueError(
            f"`{arg}`: unknown device {name!r}; known devices: {sorted(known.values())}"
        )
    path = DEVICES_DIR / f"{known[name.lower()]}.json"
    return DeviceProfile.from_dict(json.loads(path.read_text()), f"device profile file {path}")


# CUDA device names (torch.cuda.get_device_name) -> profile: the SXM parts the profiles describe
_GPU_NAMES = (
    (("H100",), "H100-80G"),
    (("H800",), "H800-80G"),
    (("H200",), "H200-141G"),
    (("A100", "80GB"), "A100-80G"),
    (("A100",), "A100-40G"),
)


def profile_for_gpu(device_name: str) -> str | None:
    """The shipped profile of a CUDA device by its name (``NVIDIA H100 80GB HBM3`` -> H100-80G);
    None for a device without one (a PCIe part's lower clocks and bandwidth are not described)."""
    if "PCIe" in device_name:
        return None
    for parts, profile in _GPU_NAMES:
        if all(p in device_name for p in parts):
            return profile
    return None


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` devices each. Ranks are numbered node by node, so a group
    of consecutive ranks no longer than a node (a TP group whose size divides ``per_node``)
    talks over the node's links, and any other group over the network."""

    nodes: int
    per_node: int
    device: DeviceProfile

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.per_node}x{self.device.name}"

    @classmethod
    def parse(cls, text: str, arg: str = "--cluster") -> Cluster:
        """``NODESxPER_NODExDEVICE``, e.g. ``16x8xH100-80G``; each error is one line naming ``arg``."""
        m = _CLUSTER.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(
                f"`{arg}` must be NODESxPER_NODExDEVICE, e.g. 16x8xH100-80G; got {text!r} "
                f"(devices: {device_names()})"
            )
        nodes, per_node = int(m[1]), int(m[2])
        device = device_profile(m[3], arg)
        if nodes < 1 or per_node < 1:
            raise ValueError(
                f"`{arg}` {text!r}: nodes and devices per node must be at least 1, got "
                f"{nodes} node(s) of {per_node}"
            )
        if per_node > device.max_devices_per_node:
            raise ValueError(
                f"`{arg}` {text!r}: a {device.name} node holds at most "
                f"{device.max_devices_per_node} devices, got {per_node} per node"
            )
        return cls(nodes, per_node, device)

    def link(self, group_size: int, span: int) -> tuple[float, float]:
        """(bytes/s each way after the link efficiency, seconds of latency per collective) of a
        group of ``group_size`` ranks spread over ``span`` consecutive ranks."""
        d = self.device
        if group_size <= 1:
            return float("inf"), 0.0
        inside = span <= self.per_node and self.per_node % span == 0
        if inside:
            return d.intra_node_bandwidth * d.link_efficiency, d.intra_node_latency_s
        return d.inter_node_bandwidth * d.link_efficiency, d.inter_node_latency_s
