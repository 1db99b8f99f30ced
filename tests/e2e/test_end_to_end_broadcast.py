"""`trainer.weight_sync: broadcast` through all services, started the way `make up` starts them:
the trainer streams every version to the torch rollouts over one gloo group on loopback (no
`trainer.nccl_master`: its store is on a port the OS gave it, and the rollouts learn the
address through the scheduler), and a second rollout that joins mid-run loads the newest stored
version first, then takes the broadcasts (the group rebuilt with it); the demo's Megatron
trainer streams the same way."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.client import AsyncrlClient, is_terminal
from tests.cluster import wait_for
from tests.e2e.experiment import (
    _settled_ledger,
    assert_completed,
    assert_ledger_clean,
    run_experiment,
    small_spec,
)

pytestmark = pytest.mark.timeout(900)
STEPS = 10_000  # runs until cancelled, once the joined rollout took broadcasts


def test_broadcast_run_goes_on_and_a_joining_rollout_takes_the_store_then_the_stream(cluster, task):
    spec = small_spec(task, total_steps=STEPS, weight_sync="broadcast")  # no nccl_master
    spec["dataset"]["epochs"] = 100_000

    def both_streamed() -> bool:
        sent = cluster.events("trainer", "broadcast_sent")
        return sum(e["rollouts"] == 2 for e in sent) >= 2

    async def scenario():
        async with AsyncrlClient(cluster.scheduler) as client:
            exp = await client.submit(spec)
            deadline = time.monotonic() + 400
            while (await client.get(exp.id)).progress.version < 3:
                assert time.monotonic() < deadline and not is_terminal(await client.get(exp.id))
                await asyncio.sleep(0.5)
            done = await asyncio.to_thread(cluster.sup, "scale", "rollout", "2")
            assert done.returncode == 0, done.stdout + done.stderr
            while not both_streamed():
                assert time.monotonic() < deadline and not is_terminal(await client.get(exp.id))
                await asyncio.sleep(0.5)
            return await client.cancel(exp.id)

    try:
        exp = asyncio.run(scenario())
    finally:  # the cluster is shared: back to one rollout
        cluster.sup("scale", "rollout", "1")
    report = wait_for(lambda: _settled_ledger(cluster, exp), timeout=60)
    assert report["totals"]["lost"] == 0 and report["totals"]["trained_twice"] == 0
    sent = cluster.events("trainer", "broadcast_sent")
    assert all(e["bytes"] > 0 for e in sent)
    hosted = [
        e for e in cluster.events("trainer", "broadcast_store_hosted") if e["experiment"] == exp.id
    ]
    assert hosted and int(hosted[0]["address"].rsplit(":", 1)[1]) > 0  # a port the OS gave
    assert not cluster.events("scheduler", "weights_fingerprint_mismatch")
    assert not cluster.events("rollout", "broadcast_not_taken", 0)
    assert cluster.events("rollout", "weights_streamed", 0)
    loaded = cluster.events("rollout", "experiment_loaded", 1)
    streamed = cluster.events("rollout", "weights_streamed", 1)
    assert loaded and streamed, "the second rollout loads from the store, then streams"
    assert loaded[0]["version"] >= 3 and loaded[0]["version"] < streamed[0]["version"]


def test_megatron_trainer_streams_to_the_torch_engine(cluster, task):
    """The demo's backend (Megatron-Core, TP = 1): its gathered HF weights are what is packed."""
    pytest.importorskip("megatron.core")
    spec = small_spec(task, backend="megatron", weight_sync="broadcast")
    exp = asyncio.run(run_experiment(cluster.scheduler, spec))
    assert_completed(exp)
    assert_ledger_clean(cluster, exp)
    sent = [e for e in cluster.events("trainer", "broadcast_sent") if e["experiment"] == exp.id]
    assert len(sent) >= 2 and all(e["rollouts"] >= 1 for e in sent)
    assert not cluster.events("scheduler", "weights_fingerprint_mismatch")
