"""scripts/probe_reading.py (issue 2's diagnostic, figures quoted in README) runs end to end on a
few games, writes what it prints, and compares its arms from one and the same starting model."""

import csv
import math

import pytest

from tests.load import load_repo_file


@pytest.fixture(scope="module")
def probe():
    return load_repo_file("scripts/probe_reading.py", "probe_reading")


def test_probe_writes_one_row_per_arm_and_evaluation(probe, tmp_path):
    out = tmp_path / "probe.csv"
    rows = probe.main(["--steps", "2", "--eval-every", "1", "--games", "12", "6", "--out", str(out)])
    assert [(r["arm"], r["step"]) for r in rows] == [(a, s) for a in probe.ARMS for s in range(3)]
    with out.open() as f:
        assert [dict(r) for r in csv.DictReader(f)] == [{k: str(v) for k, v in r.items()} for r in rows]
    for r in rows:
        assert 0.0 <= r["column6_full_greedy_legal"] <= 1.0 and math.isfinite(r["answer_sensitivity"])
    # every arm starts from the same random model: identical first evaluation
    firsts = {(r["column6_full_greedy_legal"], r["answer_sensitivity"]) for r in rows if r["step"] == 0}
    assert len(firsts) == 1


def test_scripted_contexts_label_legal_columns_and_grow_with_the_chat(probe):
    tok = probe.build_char_tokenizer()
    short = probe.scripted_contexts(tok, 3, 0, multi_turn=False)
    long = probe.scripted_contexts(tok, 3, 0, multi_turn=True)
    assert [legal for _, legal in short] == [legal for _, legal in long]
    assert all(legal and set(legal) <= set(range(7)) for _, legal in short)
    assert max(len(ids) for ids, _ in long) > 3 * max(len(ids) for ids, _ in short)
