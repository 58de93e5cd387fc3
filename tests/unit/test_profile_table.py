"""ProfileTable: lookups and interpolation, JSON round trip and validation, heatmaps."""

from __future__ import annotations

import json
import math

import pytest

from earl_lightning.parallel.layout import Layout
from earl_lightning.parallel.throughput import ProfileError, ProfileTable, layout_key, work_tokens

TP1, TP2 = Layout(dp=2, tp=1), Layout(dp=1, tp=2)


def table() -> ProfileTable:
    t = ProfileTable("earl-tiny", 2, device="cpu")
    for ctx, a, b in ((256, 1000.0, 600.0), (1024, 500.0, 450.0), (4096, 100.0, 300.0)):
        t.add("rollout", ctx, 32, TP1, a)
        t.add("rollout", ctx, 32, TP2, b)
        t.add("rollout", ctx, 128, TP1, 2 * a)
    t.add("train", 512, 16, "dp2xtp1", 5000.0)
    return t


def test_exact_cells_and_listing():
    t = table()
    assert t.lookup("rollout", TP1, 1024, 32) == 500.0
    assert t.lookup("rollout", TP2, 4096, 32) == 300.0
    assert t.stages() == ["rollout", "train"]
    assert t.layouts("rollout") == ["dp2xtp1", "dp1xtp2"]  # ordered by tp
    assert t.contexts("rollout") == [256, 1024, 4096] and t.num_seqs_buckets("rollout") == [32, 128]
    assert len(t) == 10


def test_linear_in_log_context_between_buckets():
    t = table()
    # 512 is halfway between 256 and 1024 in log2 space
    assert t.lookup("rollout", TP1, 512, 32) == pytest.approx(750.0)
    x = 2048
    w = (math.log(x) - math.log(1024)) / (math.log(4096) - math.log(1024))
    assert t.lookup("rollout", TP2, x, 32) == pytest.approx(450.0 + w * (300.0 - 450.0))


def test_clamped_outside_the_measured_range():
    t = table()
    assert t.lookup("rollout", TP1, 16, 32) == 1000.0
    assert t.lookup("rollout", TP1, 100_000, 32) == 100.0
    assert t.lookup("rollout", TP1, 1024, 1) == 500.0  # below the smallest num_seqs bucket
    assert t.lookup("rollout", TP1, 1024, 10_000) == 1000.0  # above the largest


def test_interpolates_between_num_seqs_buckets():
    t = table()
    # 64 is halfway between 32 and 128 in log space; at context 512 the curves give 750 and 1500
    assert t.lookup("rollout", TP1, 512, 64) == pytest.approx(1125.0)
    # a layout measured at one num_seqs bucket only uses that curve for every num_seqs
    assert t.lookup("rollout", TP2, 1024, 128) == 450.0


def test_layout_knobs_fall_back_to_dp_tp_name():
    t = table()
    knobbed = Layout(dp=2, tp=1, micro_batch_tokens=8192, activation_checkpointing=True)
    assert layout_key(knobbed) == "dp2xtp1-mbt8192-ckpt"
    assert t.lookup("rollout", knobbed, 1024, 32) == 500.0
    t.add("rollout", 1024, 32, knobbed, 123.0)  # an exact measurement of the variant wins
    assert t.lookup("rollout", knobbed, 1024, 32) == 123.0
    assert t.lookup("rollout", TP1, 1024, 32) == 500.0


def test_unmeasured_layout_or_stage_is_none():
    t = table()
    assert t.lookup("experience", TP1, 1024, 32) is None
    assert t.lookup("train", TP2, 512, 16) is None
    assert t.has("train", TP1) and not t.has("train", TP2)


def test_work_tokens_units():
    st = dict(num_seqs=8, context_mean=300, context_max=512, context_p95=500, gen_len=64)
    assert work_tokens("rollout", st) == 8 * 64
    assert work_tokens("train", st) == work_tokens("experience", st) == 8 * 300


def test_save_load_round_trip(tmp_path):
    t = table()
    path = t.save(tmp_path / "sub" / "profile.json")
    back = ProfileTable.load(path, model="earl-tiny", world_size=2)
    assert back == t and back.device == "cpu"
    assert back.lookup("rollout", TP2, 2048, 32) == t.lookup("rollout", TP2, 2048, 32)
    assert json.loads(path.read_text())["schema_version"] == 1
    assert not list(path.parent.glob("*.tmp*"))  # written atomically


def test_later_measurement_replaces_cell():
    t = table()
    t.add("rollout", 256, 32, TP1, 1.5)
    assert t.lookup("rollout", TP1, 256, 32) == 1.5 and len(t) == 10


# ---- errors ------------------------------------------------------------------------------
def _write(tmp_path, data) -> str:
    p = tmp_path / "p.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_load_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"cannot read profile file '.*nope\.json'"):
        ProfileTable.load(tmp_path / "nope.json")


def test_load_not_json(tmp_path):
    path = _write(tmp_path, '{"schema_version": 1, "entries": [')
    with pytest.raises(ProfileError, match=rf"profile file '{path}' is corrupt: not valid JSON"):
        ProfileTable.load(path)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda d: d.update(schema_version=7),
            r"has schema_version 7; this version of earl_lightning reads schema_version 1",
        ),
        (lambda d: d.pop("schema_version"), r"has schema_version None"),
        (
            lambda d: d.update(world_size=0),
            r"is corrupt: `world_size` must be a positive integer, got 0",
        ),
        (lambda d: d.update(model=""), r"is corrupt: `model` must be a non-empty string"),
        (lambda d: d.update(entries={}), r"is corrupt: `entries` must be a list, got dict"),
        (lambda d: d["entries"].append(3), r"is corrupt: entries\[10\] must be an object, got 3"),
        (
            lambda d: d["entries"][2].update(tokens_per_s=-5),
            r"is corrupt: entries\[2\]: `tokens_per_s` must be a positive number, got -5",
        ),
        (
            lambda d: d["entries"][0].update(stage="rolout"),
            r"is corrupt: entries\[0\]: unknown stage 'rolout'",
        ),
        (
            lambda d: d["entries"][0].update(context=12.5),
            r"is corrupt: entries\[0\]: `context` must be a positive integer, got 12.5",
        ),
        (
            lambda d: d["entries"][0].update(layout="tp2"),
            r"is corrupt: entries\[0\]: `layout` must be a Layout or a key like",
        ),
        (
            lambda d: d["entries"][0].update(layout="dp4xtp1"),
            r"is corrupt: entries\[0\]: layout 'dp4xtp1' spans 4 ranks, but the table is for world_size=2",
        ),
    ],
)
def test_load_corrupt_content(tmp_path, mutate, match):
    data = table().to_dict()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ProfileError, match=rf"profile file '{path}' " + match):
        ProfileTable.load(path)


def test_load_top_level_not_object(tmp_path):
    path = _write(tmp_path, "[1, 2]")
    with pytest.raises(ProfileError, match=r"is corrupt: expected a JSON object, got list"):
        ProfileTable.load(path)


def test_load_mismatched_world_size_or_model(tmp_path):
    path = table().save(tmp_path / "p.json")
    with pytest.raises(
        ProfileError,
        match=rf"profile file '{path}' was measured for world_size=2, but this run "
        r"has world_size=4; profile again",
    ):
        ProfileTable.load(path, world_size=4)
    with pytest.raises(
        ProfileError, match=r"was measured for model 'earl-tiny', but this run uses 'qwen'"
    ):
        ProfileTable.load(path, model="qwen", world_size=2)


def test_profile_error_is_value_error():
    assert issubclass(ProfileError, ValueError)


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ("rollout", 0, 4, TP1, 1.0),
            r"ProfileTable.add: `context` must be a positive integer, got 0",
        ),
        (("rollout", 8, True, TP1, 1.0), r"`num_seqs` must be a positive integer, got True"),
        (
            ("rollout", 8, 4, TP1, float("inf")),
            r"`tokens_per_s` must be a positive number, got inf",
        ),
        (
            ("roll", 8, 4, TP1, 1.0),
            r"unknown stage 'roll'; valid stages: \['rollout', 'experience', 'train'\]",
        ),
        (("rollout", 8, 4, Layout(dp=4), 1.0), r"layout 'dp4xtp1' spans 4 ranks"),
    ],
)
def test_add_errors(args, match):
    with pytest.raises(ValueError, match=match):
        table().add(*args)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(model="", world_size=2), r"`model` must be a non-empty string, got ''"),
        (dict(model="m", world_size=-1), r"`world_size` must be a positive integer, got -1"),
    ],
)
def test_constructor_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ProfileTable(**kw)


def test_lookup_unknown_stage():
    with pytest.raises(ValueError, match=r"unknown `stage` 'gen'"):
        table().lookup("gen", TP1, 100, 1)


# ---- heatmap -----------------------------------------------------------------------------
def test_heatmaps_written(tmp_path):
    import matplotlib.image

    paths = table().heatmaps(tmp_path, prefix="tiny")
    assert [p.name for p in paths] == ["tiny_rollout.png", "tiny_train.png"]
    img = matplotlib.image.imread(paths[0])
    assert img.shape[0] > 50 and img.shape[1] > 100  # a real picture, not an empty file
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_stage_without_data(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"`stage` 'experience' has no entries in this table; stages with data: "
        r"\['rollout', 'train'\]",
    ):
        table().heatmap("experience", tmp_path / "x.png")
