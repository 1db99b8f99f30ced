"""GroupId: the one place a training group id is formatted and parsed."""

from __future__ import annotations

import pytest

from asyncrl.types import GroupId


def test_group_id_formats_experiment_epoch_index_attempt():
    gid = GroupId(experiment_id="math-rl-1-a10b97", epoch=2, index=17, attempt=3)
    assert str(gid) == "math-rl-1-a10b97-e2-p17-a3"


@pytest.mark.parametrize(
    "experiment_id",
    ["exp", "math-rl-1-a10b97", "x-e1-p2-a3", "a-a1", "e-e0-p0-a0-e9"],
)
def test_group_id_parse_reads_back_what_str_wrote(experiment_id):
    gid = GroupId(experiment_id=experiment_id, epoch=4, index=1234, attempt=11)
    assert GroupId.parse(str(gid)) == gid


@pytest.mark.parametrize(
    "text",
    [
        "exp-eval-v4-p2-a0",  # an eval group's id
        "exp-e1-p2",  # no attempt
        "-e1-p2-a3",  # no experiment
        "exp-e1-p2-a3:0",  # a request id
        "exp-e1-px-a3",
        "",
    ],
)
def test_group_id_parse_other_ids_none(text):
    assert GroupId.parse(text) is None
