"""LoRA through `earl fit` (issue 44, item 1): GRPO and PPO steps with a KL term change only the
adapters (and the value head), the KL reference is the base model with no second copy loaded, the
exported directory is the merged plain model with the trained policy's log-probs, a resumed run
ends where an uninterrupted one does, and dp=2 under EarlStrategy trains and exports.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import earl_lightning.train.forward as forward
from earl_lightning.cli import main
from earl_lightning.models import load_model, resolve_model_path
from earl_lightning.models.lora import LoraSettings, apply_lora
from tests.distributed.launch import subprocess_env
from tests.e2e.test_export import token_logprobs
from tests.e2e.test_file_errors import error_line, fit, last_ckpt, recipe_saving_last_every_step
from tests.earl_process import run_earl_process

RECIPES = Path(__file__).parents[2] / "recipes"
LORA = ("--model.peft.r", "4", "--model.peft.alpha", "8", "--model.algorithm.kl.coef", "0.1")
# legal moves only: the untrained model's illegal ones all score the same, and GRPO would learn nothing
SMALL = (
    "--data.batch_size",
    "8",
    "--data.group_size",
    "4",
    "--model.rollout.sampling.allowed_tokens",
    '["0", "1", "2", "3", "4", "5", "6"]',
)
IDS = [1, 5, 9, 14, 3, 22, 7, 11, 30, 2]


def adapted_policy(ckpt: Path, settings: LoraSettings) -> torch.nn.Module:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    model = apply_lora(load_model("earl-tiny"), settings)
    model.load_state_dict(
        {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
    )
    return model.eval()


@pytest.mark.parametrize("recipe", ["connect4_grpo", "connect4_ppo"])
def test_a_lora_step_trains_only_the_adapters_against_the_base_model(tmp_path, monkeypatch, recipe):
    base = load_model("earl-tiny").eval()
    same_as_base: list[bool] = []
    original = forward.fill_logprobs

    def spy(model, batch, *, name, **kw):
        out = original(model, batch, name=name, **kw)
        if name == "ref_logprobs":
            want = original(base, batch, name=name, **{**kw, "value_head": None})
            same_as_base.append(torch.equal(out.tokens[name], want.tokens[name]))
        return out

    monkeypatch.setattr(forward, "fill_logprobs", spy)
    main(
        fit(
            recipe_saving_last_every_step(tmp_path, RECIPES / f"{recipe}.yaml"),
            tmp_path / "run",
            2,
            *SMALL,
            *LORA,
        )
    )
    assert same_as_base == [True, True]  # step 2's reference too, after the adapters moved
    ckpt = torch.load(last_ckpt(tmp_path / "run"), map_location="cpu", weights_only=True)
    state = {
        k[len("policy.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")
    }
    adapters = [k for k in state if ".lora_" in k]
    for name, value in base.state_dict().items():
        key = (
            name
            if name in state
            else name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        )
        assert torch.equal(state[key], value), f"base weight {key} changed"
    assert any(state[k].abs().max() > 0 for k in adapters if ".lora_B." in k), (
        "the adapters did not train"
    )
    in_optimizer = sum(len(g["params"]) for g in ckpt["optimizer_states"][0]["param_groups"])
    # + the value head
    assert in_optimizer == len(adapters) + (2 if recipe == "connect4_ppo" else 0)

    exported = tmp_path / "run" / "hf_model"
    assert not [
        k
        for k in load_file(str(exported / "model.safetensors"))
        if "lora" in k or "base_layer" in k
    ]
    from transformers import AutoModelForCausalLM

    plain, info = AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
    assert not any(info.values()), info
    trained = adapted_policy(last_ckpt(tmp_path / "run"), LoraSettings(r=4, alpha=8.0))
    torch.testing.assert_close(
        token_logprobs(plain.eval(), IDS), token_logprobs(trained, IDS), rtol=0, atol=1e-5
    )
    assert (token_logprobs(base, IDS) - token_logprobs(trained, IDS)).abs().max() > 1e-4

    main(
        [
            "export",
            "--ckpt_path",
            str(last_ckpt(tmp_path / "run")),
            "--out",
            str(tmp_path / "again"),
        ]
    )
    again, ours = (
        load_file(str(tmp_path / "again" / "model.safetensors")),
        load_file(str(exported / "model.safetensors")),
    )
    assert sorted(again) == sorted(ours) and all(torch.equal(again[k], ours[k]) for k in ours)


def test_a_resumed_lora_run_ends_where_an_uninterrupted_one_does(tmp_path):
    recipe = RECIPES / "connect4_grpo.yaml"
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    short = (
        *SMALL,
        *LORA,
        "--model.rollout.max_turns",
        "6",
    )  # three fits: short episodes keep it quick
    main(fit(recipe_saving_last_every_step(full, recipe), full / "run", 2, *short))
    main(fit(recipe_saving_last_every_step(part, recipe), part / "run", 1, *short))
    main(
        fit(
            recipe_saving_last_every_step(part, recipe),
            part / "run",
            2,
            *short,
            "--ckpt_path",
            "last",
        )
    )
    a = torch.load(last_ckpt(full / "run"), map_location="cpu", weights_only=True)
    b = torch.load(last_ckpt(part / "run"), map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == 2
    assert any(".lora_A." in k for k in a["state_dict"])
    for k, v in a["state_dict"].items():
        assert torch.equal(b["state_dict"][k], v), f"parameter {k} differs"


def test_lora_on_two_processes_under_earl_strategy(tmp_path):
    """dp=2: FSDP2 shards base and adapters, rollout and experience run on whole replicas that carry
    the adapters (the reference with them off), the export gathers and merges, and `earl export`
    of the DCP checkpoint gives the same weights."""
    recipe = recipe_saving_last_every_step(tmp_path, RECIPES / "connect4_grpo.yaml")
    earl = Path(sys.executable).with_name("earl")
    proc = run_earl_process(
        [
            str(earl),
            *fit(
                recipe,
                tmp_path / "run",
                2,
                *SMALL,
                *LORA,
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                "earl",
                "--data.batch_size",
                "16",
            ),
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    from tests.e2e.test_multiprocess import scalars

    s = scalars(tmp_path / "run")
    assert s["layout/train/dp"] == [2.0, 2.0] and max(s["logprob/mismatch"]) < 1e-4
    assert s["grad_norm"][0] > 0
    weights = load_file(str(tmp_path / "run" / "hf_model" / "model.safetensors"))
    assert sorted(weights) == sorted(
        load_file(f"{resolve_model_path('earl-tiny')}/model.safetensors")
    )
    dcp = tmp_path / "run" / "checkpoints" / "last.ckpt"  # the DCP directory both processes wrote
    main(["export", "--ckpt_path", str(dcp), "--out", str(tmp_path / "from_dcp")])
    again = load_file(str(tmp_path / "from_dcp" / "model.safetensors"))
    assert sorted(again) == sorted(weights) and all(
        torch.equal(again[k], weights[k]) for k in weights
    )


@pytest.mark.parametrize(
    "flag, value, line",
    [
        (
            "--model.peft.r",
            "0",
            "`--model.peft.r` must be a positive integer (the adapters' rank), got 0",
        ),
        (
            "--model.peft.dropout",
            "1.5",
            "`--model.peft.dropout` must be a number in [0, 1), got 1.5",
        ),
        # found in the model's architecture (built on the meta device) before anything runs
        (
            "--model.peft.target_modules",
            "[nope]",
            "`--model.peft.target_modules` ['nope'] matches no module of Qwen2ForCausalLM; its "
            "linear layers are named down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj "
            "(a list of these, a regular expression over module paths, or 'all-linear')",
        ),
        (
            "--model.peft.target_modules",
            "[embed_tokens]",
            "`--model.peft.target_modules` ['embed_tokens'] selects 'model.embed_tokens' "
            "(Embedding); LoRA here covers linear layers only",
        ),
    ],
)
def test_a_bad_lora_setting_is_one_line_from_the_command(capsys, flag, value, line):
    from tests.e2e.test_file_errors import error_line, run_earl

    code, err = run_earl(
        capsys, fit(RECIPES / "connect4_grpo.yaml", Path("unused"), 1, flag, value)
    )
    assert code == 2 and error_line(err) == f"earl: error: {line}"


def test_lora_with_a_tensor_parallel_layout_is_one_line_before_any_process_starts(tmp_path):
    """The refusal `setup` makes on every rank (a traceback each) is made while the run is built,
    in the one process there is then: one line, exit 2."""
    earl = Path(sys.executable).with_name("earl")
    proc = run_earl_process(
        [
            str(earl),
            *fit(RECIPES / "connect4_grpo_layouts.yaml", tmp_path / "run", 1, *SMALL, *LORA),
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert error_line(proc.stderr) == (
        "earl: error: `--trainer.strategy.layouts.rollout` has tp=2, but the model carries LoRA "
        "adapters (--model.peft), which EarlStrategy does not shard with tensor parallel; use tp=1 "
        "layouts (data parallel, FSDP) or full fine-tuning"
    )
    assert "[rank" not in proc.stderr and not (tmp_path / "run").exists()
