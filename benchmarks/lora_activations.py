"""One forward + backward of the model benchmarks/lora.py uses (earl-tiny-100m's widths, 2 layers) on
4 x 960 random tokens, full fine-tuning against LoRA (r 16, alpha 32, every linear layer): what
autograd saves for backward (unique storages, parameters left out) and the process's resident
memory growth. Each side runs in a fresh process.

    python benchmarks/lora_activations.py
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/lora_activations.py   # large blocks mmap'd: freed = returned

Explains benchmarks/lora.py's peak RSS (docs/experiments/lora.md): LoRA saves less for backward,
but with glibc's default heap its extra temporaries (each adapted layer's base output, adapter
output and their sum) leave the process holding more.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def side(name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from earl_lightning.models.lora import LoraSettings, apply_lora
    from earl_lightning.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        make_tiny_model("earl-tiny-100m", num_hidden_layers=2)
    )
    if name == "lora":
        apply_lora(model, LoraSettings(r=16, alpha=32.0))
    ids = torch.randint(0, 100, (4, 960))

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def now() -> float:
        return (
            int(Path("/proc/self/statm").read_text().split()[1])
            * os.sysconf("SC_PAGE_SIZE")
            / 2**20
        )

    with torch.no_grad():
        model(ids[:1, :64])  # warm-up
    saved: dict = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in saved and not (t.requires_grad and t.is_leaf):
            saved[key] = t.untyped_storage().nbytes()
        return t

    base_peak, base_now = peak(), now()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).logits.float().log_softmax(-1).gather(-1, ids[..., None]).sum()
    held = now() - base_now
    loss.backward()
    return {
        "side": name,
        "saved_mib": sum(saved.values()) / 2**20,
        "rss_after_forward_mib": held,
        "peak_rss_growth_mib": peak() - base_peak,
    }


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(side(sys.argv[1])))
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '(glibc default)')}")
    for name in ("full", "lora"):
        out = (
            subprocess.run(
                [sys.executable, __file__, name],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        r = json.loads(out)
        print(
            f"{name:<5} saved for backward {r['saved_mib']:6.0f} MiB   RSS after forward +{r['rss_after_forward_mib']:5.0f} MiB"
            f"   peak RSS +{r['peak_rss_growth_mib']:5.0f} MiB"
        )


if __name__ == "__main__":
    main()
