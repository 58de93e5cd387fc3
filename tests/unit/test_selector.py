"""Selector on synthetic profile tables: memory filter, fastest pick with interpolation,
hysteresis, switch costs, OOM marks, state round trip, explanations and errors. Pure Python."""

from __future__ import annotations

import json

import pytest

from earl_lightning.parallel.decision import Bucket, bucket_of
from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.memory import MemoryModel
from earl_lightning.parallel.model_sizes import ModelSizes
from earl_lightning.parallel.selector import NoFeasibleLayoutError, Selector
from earl_lightning.parallel.throughput import ProfileError, ProfileTable

SIZES = ModelSizes(
    num_layers=24,
    hidden_size=1024,
    intermediate_size=2816,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    vocab_size=32000,
)
MM = MemoryModel(SIZES, "bfloat16", rollout_backend="vllm")
TP1, TP2, TP4 = Layout(dp=4, tp=1), Layout(dp=2, tp=2), Layout(dp=1, tp=4)
CANDS = [TP1, TP2, TP4]
GIB = 2**30


def stats(ctx: float, num_seqs: int = 64, gen_len: int = 128) -> dict:
    return dict(
        num_seqs=num_seqs,
        context_mean=ctx,
        context_max=ctx * 1.25,
        context_p95=ctx * 1.2,
        gen_len=gen_len,
    )


def table() -> ProfileTable:
    """Rollout: TP1 best at short contexts, TP4 at long ones (the EARL paper's Fig. 3 shape);
    train: TP1 always best."""
    t = ProfileTable("synthetic", 4)
    for ctx, a, b, c in (
        (256, 4000, 3000, 2000),
        (1024, 2000, 1900, 1500),
        (4096, 600, 900, 1000),
        (16384, 150, 300, 400),
    ):
        for lay, v in ((TP1, a), (TP2, b), (TP4, c)):
            t.add("rollout", ctx, 64, lay, float(v))
    for lay, v in ((TP1, 9000.0), (TP2, 7000.0), (TP4, 5000.0)):
        t.add("train", 1024, 64, lay, v)
    return t


def selector(**kw) -> Selector:
    args = dict(candidates=CANDS, memory_model=MM, table=table(), budget_bytes=80 * GIB)
    args.update(kw)
    return Selector(**args)


def test_picks_the_fastest_that_fits():
    s = selector()
    assert s.select("rollout", stats(256)) == TP1
    s = selector()
    assert s.select("rollout", stats(12000)) == TP4
    d = s.last_decisions["rollout"]
    assert d.predicted_tokens_per_s == pytest.approx(s.table.lookup("rollout", TP4, 12000, 64))
    assert d.predicted_bytes == MM.estimate("rollout", TP4, stats(12000)).total
    assert d.predicted_seconds == pytest.approx(64 * 128 / d.predicted_tokens_per_s)
    assert "first choice" in d.reason and not d.switched


def test_interpolated_crossover_decides():
    """Between the 1024 and 4096 buckets TP1 and TP4 cross; each side of the crossing picks its
    winner, using the interpolated values (no hysteresis: fresh selectors)."""
    t = table()
    lo, hi = 1100, 3800
    assert t.lookup("rollout", TP1, lo, 64) > t.lookup("rollout", TP4, lo, 64)
    assert t.lookup("rollout", TP1, hi, 64) < t.lookup("rollout", TP4, hi, 64)
    assert selector(hysteresis=0).select("rollout", stats(lo)) == TP1
    picked = selector(hysteresis=0).select("rollout", stats(hi))
    assert picked == max(CANDS, key=lambda c: t.lookup("rollout", c, hi, 64))


def test_drops_layouts_over_budget_with_margin():
    st = stats(8192, num_seqs=256)
    need = {c.name: MM.estimate("rollout", c, st).total for c in CANDS}
    assert need["dp1xtp4"] < need["dp4xtp1"]
    # TP1 would fit the raw budget but not with the 10% margin; TP4 fits either way
    budget = int(need["dp4xtp1"] / 0.9) - 1000
    assert need["dp1xtp4"] < budget * 0.9 < need["dp4xtp1"] < budget
    s = selector(budget_bytes=budget)
    d = s.decide("rollout", st)
    assert d.layout != TP1
    assert "dropped dp4xtp1 (needs" in d.reason
    assert not next(r for r in d.candidates if r.layout == "dp4xtp1").fits
    d0 = selector(budget_bytes=budget, safety_margin=0.0).decide("rollout", st)
    assert all(r.fits for r in d0.candidates) and "dropped" not in d0.reason


def test_no_layout_fits_reports_smallest_estimate():
    st = stats(8192, num_seqs=256)
    smallest = min(CANDS, key=lambda c: MM.estimate("rollout", c, st).total)
    est = MM.estimate("rollout", smallest, st).total
    s = selector(budget_bytes=est)  # fits the raw budget, not the margin
    with pytest.raises(
        NoFeasibleLayoutError,
        match=rf"no candidate layout fits `budget_bytes`={est} .* for stage 'rollout' with "
        rf"num_seqs=256, context_max=10240.0: the smallest estimate is {smallest.name} at "
        rf"{est / GIB:.2f} GiB \[rollout/{smallest.name}: total",
    ):
        s.select("rollout", st)
    assert issubclass(NoFeasibleLayoutError, ValueError)


def test_hysteresis_keeps_a_layout_that_is_only_slightly_slower():
    s = selector(hysteresis=0.25)
    assert s.select("rollout", stats(1024)) == TP1
    # at context 4096 TP4 (1000) is 1.67x TP1 (600): switch
    ctx = 2048  # interpolated: TP1 1300, TP2 1400, TP4 1250: TP2 only ~7.7% faster -> keep TP1
    d = s.decide("rollout", stats(ctx), current=TP1)
    assert d.layout == TP1 and not d.switched
    assert "keep dp4xtp1" in d.reason and "within the 25% hysteresis" in d.reason
    d = s.decide("rollout", stats(4096), current=TP1)
    assert d.layout == TP4 and d.switched and "switch dp4xtp1 -> dp1xtp4" in d.reason
    # and back only when TP1 is clearly faster again
    assert s.select("rollout", stats(1400), current=TP4) == TP4
    assert s.select("rollout", stats(256), current=TP4) == TP1


def test_no_flapping_around_a_bucket_edge():
    s = selector(hysteresis=0.1)
    picks = [
        s.select("rollout", stats(ctx), current=s.choices.get("rollout"))
        for ctx in (1500, 1700, 1500, 1700, 1600, 1500, 1700)
    ]
    assert len(set(picks)) == 1
    flappy = selector(hysteresis=0.0)
    flips = [flappy.select("rollout", stats(ctx)) for ctx in (1100, 3800, 1100, 3800)]
    assert flips[0] != flips[1] and flips[0] == flips[2]  # without hysteresis it does flip


def test_switch_cost_is_weighed_against_stage_time():
    st = stats(4096)  # TP4 1000 tok/s vs TP1 600: 8.2 s vs 13.7 s of rollout
    assert selector(hysteresis=0).decide("rollout", st, current=TP1).layout == TP4
    costly = selector(hysteresis=0, switch_cost_s={"rollout": 10.0})
    d = costly.decide("rollout", st, current=TP1)
    assert d.layout == TP1 and d.switch_cost_s == 0.0
    # amortized over 5 steps the same 10 s switch pays off
    assert (
        selector(hysteresis=0, switch_cost_s={"rollout": 10.0}, amortize_steps=5).select(
            "rollout", st, current=TP1
        )
        == TP4
    )


def test_switch_cost_callable_and_observed():
    calls = []

    def cost(stage, src, dst):
        calls.append((stage, src.name, dst.name))
        return 100.0 if dst.tp > src.tp else 0.0

    s = selector(hysteresis=0, switch_cost_s=cost)
    assert s.select("rollout", stats(4096), current=TP1) == TP1
    assert ("rollout", "dp4xtp1", "dp1xtp4") in calls
    s = selector(hysteresis=0, switch_cost_s={"rollout": 0.0})
    s.observe_switch("rollout", 30.0)
    s.observe_switch("rollout", 10.0)
    assert s.switch_cost("rollout", TP1, TP4) == 20.0 and s.switch_cost("rollout", TP1, TP1) == 0.0
    assert s.select("rollout", stats(4096), current=TP1) == TP1


def test_mark_infeasible_skips_at_this_and_larger_buckets():
    s = selector()
    st = stats(12000)
    assert s.select("rollout", st) == TP4
    s.mark_infeasible("rollout", st, TP4)  # e.g. the engine could not fit its KV cache
    d = s.decide("rollout", st)
    assert d.layout == TP2 and "dp1xtp4 (out of memory at this size before)" in d.reason
    assert s.is_infeasible("rollout", bucket_of(stats(14000, num_seqs=128)), TP4)
    assert not s.is_infeasible("rollout", bucket_of(stats(2000)), TP4)  # smaller: still allowed
    assert not s.is_infeasible("train", bucket_of(st), TP4)  # other stages unaffected
    s.mark_infeasible("rollout", bucket_of(st), TP2)
    s.mark_infeasible("rollout", Bucket(1, 1), TP1)  # every size
    with pytest.raises(
        NoFeasibleLayoutError,
        match=r"marked infeasible after an out-of-memory error: "
        r"\['dp4xtp1', 'dp2xtp2', 'dp1xtp4'\]",
    ):
        s.select("rollout", st)


def test_bucket_is_power_of_two_of_longest_context_and_seqs():
    assert bucket_of(
        dict(num_seqs=33, context_mean=700, context_max=1025, context_p95=900, gen_len=8)
    ) == Bucket(2048, 64)
    assert bucket_of(
        dict(num_seqs=1, context_mean=1, context_max=1, context_p95=1, gen_len=0)
    ) == Bucket(1, 1)


def test_state_dict_round_trip_decides_the_same():
    a = selector(switch_cost_s={"rollout": 2.0})
    for ctx in (256, 4096):
        a.select("rollout", stats(ctx), current=a.choices.get("rollout"))
    a.select("train", stats(1024))
    a.mark_infeasible("rollout", stats(12000), TP4)
    a.observe_switch("rollout", 3.0)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = selector(table=None, switch_cost_s={"rollout": 2.0})
    b.load_state_dict(state)
    assert b.table == a.table and b.choices == a.choices and b.state_dict() == a.state_dict()
    for ctx in (12000, 2048, 300, 16000):
        da = a.decide("rollout", stats(ctx), current=a.choices.get("rollout"))
        db = b.decide("rollout", stats(ctx), current=b.choices.get("rollout"))
        assert (da.layout, da.reason) == (db.layout, db.reason)


def test_load_state_dict_errors():
    s = selector()
    with pytest.raises(ValueError, match=r"selector state must be a dict with version 1, got 3"):
        s.load_state_dict({"version": 3})
    state = s.state_dict()
    state["choices"] = {
        "train": {"dp": 2, "tp": 2, "micro_batch_tokens": 999, "activation_checkpointing": False}
    }
    with pytest.raises(
        ValueError,
        match=r"selector state chose dp2xtp2-mbt999 for stage 'train', which is not "
        r"among the candidates \['dp4xtp1', 'dp2xtp2', 'dp1xtp4'\]",
    ):
        s.load_state_dict(state)
    state = s.state_dict()
    state["table"]["entries"][0]["tokens_per_s"] = "fast"
    with pytest.raises(
        ProfileError, match=r"the selector state's profile table is corrupt: entries\[0\]"
    ):
        s.load_state_dict(state)


def test_without_a_profile_keeps_what_fits():
    s = selector(table=None)
    d = s.decide("train", stats(1024))
    assert d.layout == TP1 and d.predicted_tokens_per_s is None
    assert (
        "no profile data for stage 'train'; least tensor parallelism and recomputation that fits"
        in d.reason
    )
    assert s.decide("train", stats(1024), current=TP2).reason.startswith(
        "keep dp4xtp1: no profile data"
    )
    # an unprofiled stage behaves the same with a table
    assert selector().decide("experience", stats(512), current=TP2).layout == TP2


def test_per_stage_candidates():
    s = selector(candidates={"rollout": [TP2, TP4], "experience": [TP1], "train": [TP1, TP2]})
    assert s.select("rollout", stats(256)) == TP2
    assert s.select("experience", stats(256)) == TP1
    assert s.candidates("train") == [TP1, TP2]


def test_resident_train_state_counts_in_rollout():
    mm = MemoryModel(SIZES, "bfloat16", rollout_backend="vllm", resident_train_state=True)
    s = selector(memory_model=mm)
    s.select("train", stats(1024))
    d = s.decide("rollout", stats(256))
    assert d.predicted_bytes == mm.estimate("rollout", d.layout, stats(256), train_layout=TP1).total


# ---- errors ------------------------------------------------------------------------------
def test_unknown_stage():
    with pytest.raises(
        ValueError,
        match=r"unknown `stage` 'generate'; valid stages: \['rollout', 'experience', "
        r"'train'\]",
    ):
        selector().select("generate", stats(256))
    with pytest.raises(ValueError, match=r"unknown `stage` 'gen'"):
        selector().mark_infeasible("gen", stats(256), TP1)


def test_bad_stats_and_current():
    with pytest.raises(ValueError, match=r"`stats` lacks \['gen_len'\]"):
        selector().select(
            "rollout", {"num_seqs": 1, "context_mean": 1, "context_max": 1, "context_p95": 1}
        )
    with pytest.raises(ValueError, match=r"`current` must be a Layout or None, got 'dp4xtp1'"):
        selector().select("rollout", stats(256), current="dp4xtp1")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(candidates=[]), r"`candidates` must be a non-empty list of Layout, got \[\]"),
        (dict(candidates=[TP1, "dp2xtp2"]), r"`candidates\[1\]` must be a Layout, got 'dp2xtp2'"),
        (
            dict(candidates=[TP1, Layout(dp=2, tp=1)]),
            r"`candidates\[1\]` dp2xtp1 has dp\*tp = 2, but the world size is 4",
        ),
        (
            dict(candidates=[TP1, Layout(dp=4, tp=1)]),
            r"`candidates` has duplicate layouts: \['dp4xtp1'\]",
        ),
        (
            dict(candidates={"rollout": [TP1], "train": [TP1]}),
            r"`candidates` dict must have exactly the stages "
            r"\['rollout', 'experience', 'train'\]; unknown: \[\], "
            r"missing: \['experience'\]",
        ),
        (
            dict(
                candidates=[Layout(dp=1, tp=4), Layout(dp=4, tp=1)],
                memory_model=MemoryModel(ModelSizes(2, 64, 128, 6, 6, 8, 100)),
            ),
            r"`candidates\[0\]` tp=4 does not divide the model's attention heads \(6\)",
        ),
        (dict(memory_model="mm"), r"`memory_model` must be a MemoryModel, got str"),
        (
            dict(budget_bytes=0),
            r"`budget_bytes` must be a positive number of bytes per device, got 0",
        ),
        (dict(safety_margin=1.0), r"`safety_margin` must be a number in \[0, 1\), got 1.0"),
        (dict(hysteresis=-0.1), r"`hysteresis` must be a number >= 0, got -0.1"),
        (dict(amortize_steps=0), r"`amortize_steps` must be a positive integer, got 0"),
        (
            dict(switch_cost_s={"reshard": 1.0}),
            r"`switch_cost_s` has unknown stage 'reshard'; valid stages",
        ),
        (
            dict(switch_cost_s={"train": -1}),
            r"`switch_cost_s\['train'\]` must be a number >= 0, got -1",
        ),
        (
            dict(switch_cost_s=3.0),
            r"`switch_cost_s` must be a dict stage -> seconds or a callable, got 3.0",
        ),
        (dict(table="profile.json"), r"`table` must be a ProfileTable or None, got str"),
        (
            dict(table=ProfileTable("m", 8)),
            r"the profile table was measured for world_size=8, but this run has "
            r"world_size=4",
        ),
    ],
)
def test_constructor_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        selector(**kw)


def test_observe_switch_error():
    with pytest.raises(ValueError, match=r"`seconds` must be a number >= 0, got -2"):
        selector().observe_switch("train", -2)
