"""LoRA through the scheduler: an adapter that never reached a rollout's engine is caught (the
engine answers "updated" but still holds the base: its fingerprint is not the committed
adapter's, so it is fenced while the honest rollout serves the version; issue 23 point 4's
adapter case), and the parts that cannot run LoRA refuse it at submit with INVALID_ARGUMENT
naming `trainer.lora`. Real scheduler, reward and rollout gRPC servers on port 0 against a
real nats-server; the trainer is the scheduler tests' fake, committing adapters written by the
trainer's own write_version."""

from __future__ import annotations

import grpc
import pytest

from asyncrl import fingerprint
from asyncrl.natsutil import wait_until
from asyncrl.v1 import scheduler_pb2
from services.rollout.adapters import is_adapter_dir
from services.rollout.torch_engine import TorchEngine
from services.trainer import lora
from services.trainer.publish import write_version
from tests.fakes.scheduler_env import cluster, spec, submit  # noqa: F401 - a fixture
from tests.integration.test_fleet_fingerprint import _checked, _commit, files, models  # noqa: F401
from tests.integration.test_lora import LORA, peft_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class DropsAdapters(TorchEngine):
    """A test double of the verl #7495 failure: UpdateWeights of an adapter reports success
    (the new version, no error) and the engine goes on sampling the base."""

    async def update_weights(
        self, model_dir: str, version: int, lane: str = "", keep: int | None = None
    ) -> int:
        if not is_adapter_dir(model_dir):
            return await super().update_weights(model_dir, version, lane, keep)
        self._lanes[lane] = (version, self.fingerprint_of(lane))  # the lane still on the base
        return 0


def lora_spec(files) -> str:  # noqa: F811
    return spec(
        files,
        trainer={"total_steps": 10, "lora": LORA.model_dump()},
        rollout={"max_head_offpolicyness": 4},
    )


async def test_adapter_never_applied_is_fenced_the_honest_rollout_serves_it(
    cluster,  # noqa: F811
    files,  # noqa: F811
    models,  # noqa: F811
    tmp_path,
):
    from services.reward.server import create_reward
    from services.rollout.server import create_rollout
    from tests.fakes.scheduler_env import TRAINER, FakeTrainer

    await cluster.start_scheduler(lease_ttl_s=10.0)
    reward, _ = await create_reward(
        port=0, workers=1, scheduler=cluster.address, nats_url=cluster.nats_url
    )
    cluster._closers.append(reward.close)
    await cluster.worker(TRAINER, FakeTrainer())
    exp_id = await submit(cluster, lora_spec(files))
    fleet = cluster.scheduler.get(exp_id).fleet
    ids = []
    for engine in (TorchEngine(seed=0), DropsAdapters(seed=0)):
        runtime, _ = await create_rollout(cluster.nats_url, engine, scheduler=cluster.address)
        cluster._closers.append(runtime.close)
        ids.append(runtime.worker_id)
        await wait_until(lambda: fleet.ready == set(ids), 60)
    honest, _ = ids

    adapter = peft_model(models / "v0", seed=1)
    root = tmp_path / "weights"
    uri = write_version(root, exp_id, 1, lora.adapter_files(adapter), models / "v0", keep=3)
    fp = fingerprint.read_manifest(root / exp_id / "v000001")
    await _commit(cluster, exp_id, 1, uri, fp)
    await wait_until(lambda: fleet.version == 1, 60)
    assert fleet.ready == {honest}  # the one still on the base was fenced, not counted
    assert _checked(exp_id, "match") == 1 and _checked(exp_id, "mismatch") >= 1
    exp = await cluster.experiment(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_RUNNING and exp.progress.version == 1


@pytest.mark.parametrize(
    ("section", "value", "named"),
    [
        ("trainer", {"backend": "megatron"}, "'megatron'"),
        ("trainer", {"weight_sync": "nccl", "nccl_master": "h:1", "nccl_world_size": 2}, "'nccl'"),
    ],
)
async def test_submit_lora_where_it_cannot_run_is_invalid_argument(
    cluster,  # noqa: F811
    files,  # noqa: F811
    section,
    value,
    named,
):
    await cluster.start_scheduler()
    sections = {"trainer": {"lora": LORA.model_dump()}}
    sections[section] = sections.get(section, {}) | value
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, **sections))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("trainer.lora: LoRA ") and named in e.value.details()
