"""The calculator's demonstrations written as TRL's tool-calling rows
(`scripts/make_calculator_rows.py`) train on exactly the tokens and labels of the demonstrations
themselves (plain SFT, `targets: sampled`): the structured calls encode to what the demonstrator
wrote, the tool results stay masked, and the environment's tool schema renders the rows."""

from __future__ import annotations

import json

from earl_lightning.sft import DemonstrationDataModule, WarmStartModule
from earl_lightning.sft.datamodule import training_rows
from tests.load import load_repo_file

script = load_repo_file("scripts/make_calculator_rows.py", "make_calculator_rows")


def test_the_rows_encode_to_the_demonstrations_own_tokens(tmp_path):
    played, tok = script.demonstrations(script.RECIPE, 12)
    rows = script.rows(played, tok)
    assert any(m.get("tool_calls") for r in rows for m in r["messages"]), "some rows call the tool"
    assert all(m["content"] == "" for r in rows for m in r["messages"] if m.get("tool_calls"))
    plain = training_rows(played, [[] for _ in played], expected=False)
    cfg = script.yaml.safe_load(script.RECIPE.read_text())
    module = WarmStartModule(model=cfg["model"]["model"], rollout=cfg["model"]["rollout"])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = DemonstrationDataModule(
        env="calculator", env_kwargs=cfg["data"]["env_kwargs"], dataset=str(path)
    )
    encoded = dm.encode_rows(dm.splits.train, module)
    assert [r["input_ids"] for r in encoded] == [r["input_ids"] for r in plain]
    assert [r["labels"] for r in encoded] == [r["labels"] for r in plain]
