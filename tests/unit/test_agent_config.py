"""`--data.agent` settings that cannot work are one line naming the flag, before anything runs."""

from __future__ import annotations

import json

import pytest

from earl_lightning.modules.datamodule import EpisodeDataModule


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(4)))
    return str(path)


async def needs_level(client, row, level): ...


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dataset": None},
            r"`--data.agent` plays the rows of a dataset, and `--data.dataset` is null",
        ),
        ({"env": "calculator"}, r"`--data.agent` and `--data.env` 'calculator' are both set"),
        ({"tools": ["tests.plugins.tools.add"]}, r"`--data.agent` and `--data.tools` are both set"),
        ({"agent": "math.pi"}, r"`--data.agent` 'math.pi' is float 3.14"),
        (
            {"agent": "math.sqrt"},
            r"`--data.agent` 'math.sqrt' cannot be called as agent\(client, row\)",
        ),
        ({"agent": "tests.plugins.nowhere.agent"}, r"`--data.agent`"),
        (
            {"agent": needs_level},
            r"`--data.agent` needs_level\(client, row, level\) needs \['level'\], which the dataset does not have",
        ),
    ],
)
def test_an_agent_setting_that_cannot_work_is_one_line(rows, kwargs, message):
    args = {"agent": "tests.plugins.agents.chat", "dataset": rows} | kwargs
    with pytest.raises(ValueError, match=message) as err:
        EpisodeDataModule(**args)
    assert "\n" not in str(err.value)


def test_an_agent_takes_the_rows_columns_by_name(rows):
    dm = EpisodeDataModule(agent="tests.plugins.agents.sync_agent", dataset=rows, eval_episodes=0)
    assert (
        dm.agent.__name__ == "sync_agent" and dm.hparams.agent == "tests.plugins.agents.sync_agent"
    )
