"""`trainer.weight_sync: broadcast` without `trainer.nccl_master`: the real trainer service
(torch backend, tiny model, real nats-server) hosts its group store on its advertised host at
a port the OS gave it, and every CommitWeights carries that address (`broadcast_store`) for
the scheduler to pass on; no rollout joins here, so each version's broadcast is skipped."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from asyncrl.natsutil import publish_group
from asyncrl.settings import settings
from asyncrl.v1 import trainer_pb2
from tests.fakes import trainer_env
from tests.fakes.trainer_env import EXP, _group, _spec, _wait_commits

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

scheduler = trainer_env.scheduler  # the recording scheduler and a trainer factory (fixtures)
start_trainer = trainer_env.start_trainer


async def test_trainer_commits_the_address_of_its_store_on_an_os_given_port(
    tiny, scheduler, start_trainer, js
):
    spec = json.loads(_spec(tiny[0], weight_sync="broadcast"))
    spec["rollout"]["weight_update_timeout_s"] = 3.0  # hellos awaited 1 s: none come
    _, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=json.dumps(spec)),
        timeout=60,
    )
    for version in (0, 1):  # eta 0: each step's groups from the version before it
        for gid in (f"g{version}a", f"g{version}b"):
            await publish_group(js, _group(tiny, gid, version))
        await _wait_commits(scheduler, version + 1)
    first, second = scheduler.commits[:2]
    host, port = first.broadcast_store.rsplit(":", 1)
    assert host == settings().advertise_host and 0 < int(port) < 65536
    assert second.broadcast_store == first.broadcast_store  # one store for the run
    client = TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    assert client.check([f"{EXP}/v1/plan"])  # the trainer's store: version 1's plan is there
