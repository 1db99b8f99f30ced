"""The scheduler counts a rollout as serving a committed version only when the fingerprint it
reports with UpdateWeights is the one the trainer committed: a rollout whose engine keeps its
old weights while answering "updated" is fenced (a metric counts it), the honest one serves the
version and the run goes on; after a corrupted version, every rollout is fenced and they serve
again once the next, intact version is committed. The real scheduler, reward service and
rollout gRPC servers (torch engine, tiny models) on port 0 against a real nats-server; the
trainer is the scheduler tests' fake, committing versions written by the trainer's own
write_version."""

from __future__ import annotations

import pytest

from asyncrl import fingerprint
from asyncrl.natsutil import wait_until
from asyncrl.tiny import build_tiny_model
from asyncrl.v1 import common_pb2, scheduler_pb2
from services.reward.server import create_reward
from services.rollout.server import create_rollout
from services.rollout.torch_engine import TorchEngine
from services.scheduler.fleet import WEIGHTS_CHECKED
from services.trainer.publish import write_version
from tests.fakes.scheduler_env import (
    TRAINER,
    FakeTrainer,
    cluster,  # noqa: F401 - a fixture
    spec,
    submit,
)
from tests.integration.test_weights_fingerprint import KeepsOldWeights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # deploys models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for seed in (0, 1, 2):
        build_tiny_model(root / f"v{seed}", seed=seed)
    return root


@pytest.fixture
def files(tmp_path, models):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(40)))
    return {"model": str(models / "v0"), "data": str(data)}


def _write(root, exp_id: str, version: int, model_dir) -> tuple[str, str]:
    """Version `version` in the weight store as the trainer writes it: (uri, fingerprint)."""
    files = {n: (model_dir / n).read_bytes() for n in ("model.safetensors", "config.json")}
    uri = write_version(root, exp_id, version, files, model_dir, keep=3)
    return uri, fingerprint.read_manifest(root / exp_id / f"v{version:06d}")


async def _commit(cluster, exp_id, version, uri, fp):  # noqa: F811
    return await cluster.trainer_stub.CommitWeights(
        scheduler_pb2.CommitWeightsRequest(
            experiment_id=exp_id,
            version=version,
            uri=uri,
            metrics=common_pb2.StepMetrics(step=version, version=version, groups=2),
            fingerprint=fp,
        ),
        timeout=30,
    )


def _checked(exp_id: str, result: str) -> float:
    return WEIGHTS_CHECKED.labels(exp_id, result)._value.get()


async def _start(cluster, files, engines):  # noqa: F811
    """Scheduler, reward, fake trainer, a real rollout per engine; the experiment RUNNING with
    every rollout serving v0. Returns (experiment id, rollout worker ids)."""
    await cluster.start_scheduler(lease_ttl_s=1.0)
    reward, _ = await create_reward(
        port=0, workers=1, scheduler=cluster.address, nats_url=cluster.nats_url
    )
    cluster._closers.append(reward.close)
    await cluster.worker(TRAINER, FakeTrainer())
    exp_id = await submit(
        cluster, spec(files, trainer={"total_steps": 10}, rollout={"max_head_offpolicyness": 4})
    )
    fleet = cluster.scheduler.get(exp_id).fleet
    ids = []
    for engine in engines:  # one at a time: transformers' loading is not thread-safe
        runtime, _ = await create_rollout(cluster.nats_url, engine, scheduler=cluster.address)
        cluster._closers.append(runtime.close)
        ids.append(runtime.worker_id)
        await wait_until(lambda: fleet.ready == set(ids), 60)
    return exp_id, ids


async def test_engine_keeping_old_weights_is_fenced_and_the_run_goes_on(
    cluster,  # noqa: F811
    files,
    models,
    tmp_path,
):
    exp_id, (honest, _) = await _start(
        cluster, files, [TorchEngine(seed=0), KeepsOldWeights(seed=0)]
    )
    fleet = cluster.scheduler.get(exp_id).fleet
    uri, fp = _write(tmp_path / "weights", exp_id, 1, models / "v1")
    await _commit(cluster, exp_id, 1, uri, fp)
    await wait_until(lambda: fleet.version == 1, 60)
    assert fleet.ready == {honest}  # the stuck one was fenced, not counted as serving v1
    assert _checked(exp_id, "match") == 1 and _checked(exp_id, "mismatch") >= 1
    exp = await cluster.experiment(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_RUNNING and exp.progress.version == 1


async def test_corrupted_version_fences_every_rollout_next_version_serves_again(
    cluster,  # noqa: F811
    files,
    models,
    tmp_path,
):
    exp_id, ids = await _start(cluster, files, [TorchEngine(seed=0)])
    fleet = cluster.scheduler.get(exp_id).fleet
    root = tmp_path / "weights"
    uri, fp = _write(root, exp_id, 1, models / "v1")
    weights = root / exp_id / "v000001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # corrupted after the trainer wrote it (tensor data: it still loads)
    weights.write_bytes(bytes(data))
    await _commit(cluster, exp_id, 1, uri, fp)
    await wait_until(lambda: fleet.version == 1, 60)
    assert fleet.ready == set() and _checked(exp_id, "mismatch") >= 1
    uri2, fp2 = _write(root, exp_id, 2, models / "v2")  # the next version, intact
    await _commit(cluster, exp_id, 2, uri2, fp2)
    await wait_until(lambda: fleet.version == 2 and fleet.ready == set(ids), 60)
    assert _checked(exp_id, "match") >= 1
    exp = await cluster.experiment(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_RUNNING
