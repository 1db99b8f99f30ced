"""The small end-to-end experiment with `rollout.engine: sglang`.

The rollout service runs `--engine sglang --sglang-launch` with the HTTP fake of SGLang
(tests/fakes/sglang_server.py, a real tiny model behind SGLang's API) as its launch command,
so it really launches, health-checks, updates and supervises a child server. Same checks as
with the torch engine (experiment.py); then the child is SIGKILLed mid-experiment, and last
the rollout worker itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import pytest

from asyncrl.supervisor import pid_alive
from tests.cluster import wait_for
from tests.e2e.experiment import (
    assert_completed,
    assert_dump_decodes,
    log_events,
    run_experiment,
    sglang_children,
    small_spec,
    start_cluster,
)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from start_cluster(tmp_path_factory.mktemp("var"), engine="sglang")


def test_small_experiment_with_sglang_engine_completes_through_all_services(
    cluster, task, tmp_path
):
    exp = asyncio.run(run_experiment(cluster.scheduler, small_spec(task, engine="sglang")))
    assert_completed(exp)
    assert_dump_decodes(cluster, exp, tmp_path / "traj.jsonl")
    assert len(sglang_children(cluster)) == 1  # launched on the first load, then updated


def test_sglang_child_killed_mid_experiment_restarted_with_current_weights_completes(cluster, task):
    total_steps = 30  # seen running at version 1: 6 steps can pass between two polls
    rollout_log = cluster.var / "log" / "rollout-0.log"
    killed: list[dict] = []

    def kill_child_once_updated(exp):
        # once the child serves trained weights (not its launch model's), so that the restart
        # has something to re-apply
        if killed:
            return
        served = log_events(rollout_log, "weights_updated")
        if any(e.get("experiment") == exp.id and e["version"] >= 1 for e in served):
            child = sglang_children(cluster)[-1]
            os.kill(child["pid"], signal.SIGKILL)
            killed.append(child)

    spec = small_spec(task, engine="sglang", total_steps=total_steps)
    exp = asyncio.run(
        run_experiment(cluster.scheduler, spec, on_progress=kill_child_once_updated, poll_s=0.05)
    )
    assert killed, "the experiment ended before the child could be killed"
    assert_completed(exp, total_steps)

    assert [e["code"] for e in log_events(rollout_log, "sglang_died")] == [-signal.SIGKILL]
    restarted = sglang_children(cluster)[-1]
    assert restarted["pid"] != killed[0]["pid"] and restarted["url"] == killed[0]["url"]
    (reapplied,) = log_events(rollout_log, "weights_reapplied")
    assert reapplied["version"] >= 1
    # the restarted child took every later update: it serves the final weights
    with urllib.request.urlopen(f"{restarted['url']}/model_info", timeout=10) as resp:
        assert json.load(resp)["weight_version"] == str(total_steps)


def test_rollout_worker_killed_its_sglang_child_exits_too(cluster):
    child = sglang_children(cluster)[-1]["pid"]
    assert pid_alive(child)
    (rollout,) = cluster.procs("rollout")
    os.kill(rollout["pid"], signal.SIGKILL)  # no graceful stop: the child must not be orphaned
    wait_for(lambda: not pid_alive(child), timeout=20)
