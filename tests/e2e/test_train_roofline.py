"""``benchmarks/train_roofline.py``: the batch it builds is the multi-turn comparison's, its FLOP count
is the model's (checked against the count from the config), and the script runs end to end and writes
its CSV. Timing is not asserted."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.train_roofline import count_flops, episode_ids, trl_multi_seconds


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from earl_lightning.models.loading import resolve_model_path

    path = resolve_model_path("earl-tiny")
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    )


def test_episode_is_the_whole_chat_of_every_turn(tiny):
    tokenizer, _ = tiny
    text = tokenizer.decode(episode_ids(tokenizer, turns=3, reply_len=8))
    assert text.count("<|im_start|>assistant") == 3
    assert text.count("77777777") == 3
    assert "Turn 1/3." in text and "Turn 3/3: more digits." in text


def test_flop_count_is_three_times_the_linear_layers_forward_plus_causal_attention(tiny):
    _, model = tiny
    cfg = model.config
    batch, length = 2, 40
    ids = torch.randint(3, cfg.vocab_size, (batch, length))
    counted, attention = count_flops(model, ids)
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # q, k, v, o, gate/up/down
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * cfg.intermediate_size
    linear_params = cfg.num_hidden_layers * per_layer + h * cfg.vocab_size  # + lm_head
    assert counted == pytest.approx(3 * 2 * batch * length * linear_params, rel=0.01)
    head_dim = h // cfg.num_attention_heads
    assert attention == pytest.approx(
        3
        * 2
        * 2
        * (length * length / 2)
        * head_dim
        * cfg.num_attention_heads
        * cfg.num_hidden_layers
        * batch
    )


def test_script_writes_its_csv(tmp_path):
    out = tmp_path / "roofline.csv"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "train_roofline.py"),
            "--batch",
            "2",
            "--turns",
            "2",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--micro",
            "1",
            "--attention",
            "math",
            "eager",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = {r["what"]: float(r["value"]) for r in csv.DictReader(f)}
    assert rows["batch_tokens"] == 2 * rows["episode_tokens"]
    assert rows["train_seconds"] > 0 and rows["peak_2048_gflops"] > 0
    assert 0 < rows["train_share_of_peak"] < 2
    for kernel in ("math", "eager"):
        assert (
            rows[f"train_seconds_attention_{kernel}"] > 0
            and rows[f"train_seconds_attention_{kernel}_micro_8_episodes"] > 0
        )


def test_the_attention_kernels_compared_compute_the_same_log_probs(tiny):
    """The script times SDPA's default CPU kernel against its math path and HF's eager attention:
    the same function of the same weights, so only the speed may differ."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    from earl_lightning.algorithms.logprobs import shifted_logprobs

    tokenizer, model = tiny
    ids = torch.tensor([episode_ids(tokenizer, turns=2, reply_len=8)] * 2)
    eager = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = shifted_logprobs(model(input_ids=ids).logits, ids)
        with sdpa_kernel(SDPBackend.MATH):
            math = shifted_logprobs(model(input_ids=ids).logits, ids)
        plain = shifted_logprobs(eager(input_ids=ids).logits, ids)
    torch.testing.assert_close(math, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, ref, atol=1e-5, rtol=1e-5)


def test_trls_seconds_come_from_the_multi_turn_row_of_the_same_point(tmp_path):
    csv_path = tmp_path / "vs_trl.csv"
    csv_path.write_text(
        "side,mode,completion_len,turns,seconds_per_step\n"
        "trl,multi,8,4,1.5\ntrl,single,8,1,0.3\nearl,multi,8,10,2.0\ntrl,multi,8,10,5.0\n"
    )
    assert trl_multi_seconds(csv_path, 8, 10) == 5.0  # not the first TRL multi-turn row (4 turns)
    assert trl_multi_seconds(csv_path, 8, 4) == 1.5
    assert trl_multi_seconds(csv_path, 16, 10) is None
    assert trl_multi_seconds(tmp_path / "missing.csv", 8, 10) is None
