"""`trainer.weight_sync: nccl` end to end over gloo (CPU): a real trainer service (torch backend,
tiny model) commits version 1 to a fake scheduler whose CommitWeights has a real SGLangEngine
(`weight_sync=nccl`) update the SGLang fake, which runs in its own process and receives the
tensors by collective broadcast from the trainer, one flattened bucket per broadcast. The NCCL variant of the same protocol needs
GPUs: tests/integration/test_sglang_engine.py, marked gpu."""

from __future__ import annotations

import aiohttp
import pytest

from asyncrl.fingerprint import of_dir, read_manifest
from asyncrl.ledger import ensure_ledger
from asyncrl.natsutil import publish_group, wait_until
from asyncrl.net import free_port
from asyncrl.runtime import ServiceRuntime
from asyncrl.v1 import scheduler_pb2_grpc
from asyncrl.weights import uri_to_path, version_dir
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import SGLangEngine
from services.trainer.server import create_trainer
from tests.fakes.sglang_server import spawn_fake, tensor_digest
from tests.fakes.trainer_env import EXP, RecordingScheduler, _group, _spec

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`


class UpdatingScheduler(RecordingScheduler):
    """CommitWeights updates the engine to the committed version before it answers, as the
    real scheduler's UpdateWeights to the rollout fleet does; says stop at version 1."""

    def __init__(self, engine: SGLangEngine):
        super().__init__()
        self.engine = engine
        self.stop_at_version = 1

    async def CommitWeights(self, request, context):
        await self.engine.update_weights(str(uri_to_path(request.uri)), request.version)
        return await super().CommitWeights(request, context)


async def _served_digests(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/fake_weights") as r:
        return await r.json()


async def _stats(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/fake_stats") as r:
        return await r.json()


async def test_trainer_weight_sync_nccl_over_gloo_engine_serves_committed_weights(
    tiny, nats_server, js, tmp_path
):
    port = free_port()
    with spawn_fake(tiny[0], "--weight-version", "0") as url:
        base = await _served_digests(url)
        engine = SGLangEngine(
            SGLangConfig(
                url=url,
                weight_sync="nccl",
                nccl_master=f"127.0.0.1:{port}",
                nccl_backend="gloo",
            )
        )
        await engine.start()
        await ensure_ledger(js)  # as the real scheduler does (the trainer may not create it)
        scheduler = UpdatingScheduler(engine)
        sched_rt = ServiceRuntime("fake-scheduler", grace_s=0)
        sched_port = await sched_rt.serve(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler)],
            ["asyncrl.v1.Scheduler"],
        )
        runtime, service = await create_trainer(
            nats_server.url,
            scheduler=f"127.0.0.1:{sched_port}",
            var_dir=tmp_path / "var",
            weights_dir=tmp_path / "weights",
        )
        try:
            await engine.load(str(tiny[0]), 0)  # the base model, from disk
            disk_updates = (await _stats(url))["updates"]
            spec = _spec(
                tiny[0],
                weight_sync="nccl",
                nccl_master=f"127.0.0.1:{port}",
                nccl_world_size=2,
            )
            await service.start_experiment(EXP, spec)
            assert service.sender.broadcaster.backend == "gloo"  # no CUDA here
            for gid in ("g0", "g1"):
                await publish_group(js, _group(tiny, gid, 0))
            await wait_until(lambda: service.state in ("stopped", "failed"), timeout=120)
            assert service.state == "stopped", service.message
            trained = {k: tensor_digest(v) for k, v in service.backend.model.state_dict().items()}
            served = await _served_digests(url)
            stats = await _stats(url)
            stored = version_dir(tmp_path / "weights", EXP, 1)
        finally:
            await service.close(checkpoint=False)
            await runtime.close()
            await sched_rt.close()
            await engine.stop()
    assert [c.version for c in scheduler.commits] == [1]
    assert engine.version == 1 and stats["weight_version"] == "1"
    assert stats["updates"] == disk_updates  # not from disk: the broadcast delivered them
    assert served == trained  # exactly the trainer's committed weights
    # one broadcast per bucket (the tiny model fits one 64 MiB bucket), not one per tensor
    assert stats["broadcasts"] == service.sender.broadcaster.broadcasts == 1 < len(trained)
    assert served != base  # and the step changed them
    assert (stored / "model.safetensors").is_file()  # the weight store is still written
    assert of_dir(stored) == read_manifest(stored)  # from the snapshot, its fingerprint true
    assert service.sender.broadcaster.group is None  # left when the experiment ended
