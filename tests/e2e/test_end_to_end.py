"""A small experiment through all four services, started the way `make up` starts them.

nats-server (JetStream), scheduler, reward, rollout (torch engine) and trainer run as real
processes under the supervisor; the test talks to them only through the SDK, the CLI and
the supervisor's scale command.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.cli import app as cli_app
from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.tiny import build_tiny_model
from asyncrl.v1 import common_pb2
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(900)


def _write_task(root: Path, n_train: int, n_eval: int) -> tuple[Path, Path]:
    rng = random.Random(0)

    def rows(n):
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    train, evals = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows(n_train)))
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows(n_eval)))
    return train, evals


def _spec(model: Path, train: Path, evals: Path, **trainer) -> dict:
    return {
        "name": "e2e",
        "model": {"path": str(model)},
        "dataset": {"path": str(train), "epochs": 50},
        "rollout": {
            "n_samples": 4,
            "max_head_offpolicyness": 1,
            "max_concurrent_rollouts": 8,
            "filter": "none",  # a random model rarely gets a reward: keep every group
            "gconfig": {"temperature": 1.0, "max_new_tokens": 4},
        },
        "reward": {"function": "exact_match"},
        "trainer": {"backend": "torch", "batch_size": 2, "total_steps": 4, "lr": 1e-3,
                    "checkpoint_every": 2, **trainer},
        "eval": {"dataset_path": str(evals), "every_versions": 2, "n_samples": 1,
                 "gconfig": {"temperature": 0.0, "max_new_tokens": 4}},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    var = tmp_path_factory.mktemp("var")
    c = Cluster(var)
    started = c.sup("start", "--timeout", "240", timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    c.state()
    yield c
    c.kill_all()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    build_tiny_model(root / "model", hidden_size=32, intermediate_size=64)
    return (root / "model", *_write_task(root, n_train=64, n_eval=8))


async def _run(scheduler: str, spec: dict, timeout: float = 600):
    async with AsyncrlClient(scheduler) as client:
        exp = await client.submit(spec)
        deadline = time.monotonic() + timeout
        while not is_terminal(exp):
            assert time.monotonic() < deadline, f"experiment stuck in {state_name(exp.state)}"
            await asyncio.sleep(0.5)
            exp = await client.get(exp.id, with_history=True)
        return exp


def test_small_experiment_completes_through_all_services(cluster, task, tmp_path):
    model, train, evals = task
    spec = _spec(model, train, evals)
    exp = asyncio.run(_run(cluster.scheduler, spec))
    assert state_name(exp.state) == "COMPLETED", exp.message
    p = exp.progress
    assert p.version == 4
    assert [h.version for h in exp.history] == [1, 2, 3, 4]
    assert all(h.groups == 2 for h in exp.history)
    # bounded staleness: no trained group lags more than eta = 1
    assert max(h.staleness_max for h in exp.history) <= 1
    # eval at the start, every 2 versions and at the end
    assert sorted({e.version for e in p.evals}) == [0, 2, 4]
    assert all(e.n_samples == 8 for e in p.evals)

    # trajectories can be read back from JetStream and decoded to text
    out = tmp_path / "traj.jsonl"
    runner = CliRunner()
    result = runner.invoke(
        cli_app, ["--scheduler", cluster.scheduler, "dump", exp.id, "--out", str(out),
                  "--nats", f"nats://127.0.0.1:{cluster.nats_port}"])
    assert result.exit_code == 0, result.output
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) >= 8  # B * total_steps trained groups at least
    first = groups[0]
    assert len(first["samples"]) == 4
    for s in first["samples"]:
        assert len(s["versions"]) == len(s["output_ids"]) == len(s["logprobs"])


def test_scale_rollout_and_reward_during_a_run_new_replicas_get_work(cluster, task):
    model, train, evals = task
    spec = _spec(model, train, evals, total_steps=100_000)  # runs until cancelled

    async def scenario():
        async with AsyncrlClient(cluster.scheduler) as client:
            exp = await client.submit(spec)
            for service in ("rollout", "reward"):
                done = await asyncio.to_thread(cluster.sup, "scale", service, "2")
                assert done.returncode == 0, done.stdout + done.stderr
            deadline = time.monotonic() + 240
            while True:
                workers = await client.workers()
                rollouts = [w for w in workers if w.kind == common_pb2.WORKER_KIND_ROLLOUT]
                busy = [w for w in rollouts if w.experiment_id == exp.id and w.groups_done > 0]
                if len(rollouts) == 2 and len(busy) == 2:
                    break
                assert time.monotonic() < deadline, [(w.name, w.groups_done) for w in rollouts]
                assert not is_terminal(await client.get(exp.id))
                await asyncio.sleep(0.5)
            await asyncio.sleep(2.0)  # let both reward replicas see a few Score calls
            exp = await client.cancel(exp.id)
            return exp

    exp = asyncio.run(scenario())
    assert state_name(exp.state) == "CANCELLED"
    # both reward replicas scored items: each logs its batches
    logs = sorted((cluster.var / "log").glob("reward-*.log"))
    assert len(logs) == 2
    assert all("score" in p.read_text() for p in logs), [p.read_text()[-500:] for p in logs]
    wait_for(lambda: len(cluster.workers(common_pb2.WORKER_KIND_REWARD)) == 2)
