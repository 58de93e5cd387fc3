"""scripts/probe_legality.py (the Connect Four legality figures of docs/experiments/warm_start.md)
runs end to end: its positions are the rollout's prompts with their legal columns, and a random
model's mass on full columns is what a near-uniform policy puts there."""

from __future__ import annotations

from earl_lightning.envs.openspiel_env import legal_from_observation
from earl_lightning.models import load_tokenizer
from tests.load import load_repo_file


def test_probe_legality_on_random_weights():
    probe = load_repo_file("scripts/probe_legality.py", "probe_legality")
    tok = load_tokenizer("earl-tiny")
    positions = probe.positions(tok, 12)
    assert len(positions) > 60
    for prompt, legal in positions:
        assert legal_from_observation(tok.decode(prompt, skip_special_tokens=True)) == legal  # the prompt's own Legal: line (history 0)
    full = [len(legal) for _, legal in positions if len(legal) < 7]
    row = probe.probe("random weights=earl-tiny", positions)
    assert row["model"] == "random weights" and row["positions"] == len(positions)
    assert row["with_full_column"] == len(full) > 0
    # a near-uniform policy over 7 columns puts about (7 - legal) / 7 on the full ones
    uniform = sum((7 - n) / 7 for n in full) / len(full)
    assert abs(row["full_column_mass"] - uniform) < 0.1
